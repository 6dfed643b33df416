"""Retry delays: exponential with full jitter, so many relays and consumers do not retry in step.

The one backoff of the package: the relay's row retries and reconnects, and the
consumer runners' redelivery delays (AWS's "full jitter": uniform from zero).
"""

from __future__ import annotations

import random


def full_jitter(attempt: int, *, base: float, cap: float) -> float:
    """Seconds to wait before attempt ``attempt + 1``: uniform in [0, min(cap, base·2^(n-1))]."""
    exponent = min(max(attempt - 1, 0), 62)
    return random.uniform(0.0, min(cap, base * (2.0**exponent)))


def bounded_retry_after(retry_after: float | None, cap: float) -> float:
    """A publisher's ``retry_after`` as a delay in [0, cap]: None, NaN and negatives mean none.

    Any publisher (third-party ones too) may ask for anything: 1e20 s, a receiver's
    absurd Retry-After, overflowed the settle's timestamp and failed every settle of the row.
    """
    if retry_after is None or not retry_after > 0:
        return 0.0
    return min(retry_after, cap)


class Backoff:
    """Reconnect pacing for one dependency: grows on failure, resets on success."""

    def __init__(self, *, base: float = 0.2, cap: float = 10.0) -> None:
        self.base = base
        self.cap = cap
        self.failures = 0

    def next_delay(self) -> float:
        self.failures += 1
        # Never below base/2: a dead server must not turn the relay into a busy loop.
        return max(self.base / 2, full_jitter(self.failures, base=self.base, cap=self.cap))

    def reset(self) -> None:
        self.failures = 0
