"""Publish failures as an outage: a WARNING when it starts, reminders, an INFO when it ends.

With the broker down every claimed event fails, is retried and fails again: a line per
failure was thousands of lines a second (issue 12). The details of each failure stay at
DEBUG; this tracker turns the stream of failures into a handful of lines per relay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from outboxkit._redact import redact
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.sink.observer import RelayObserver

__all__ = ["OutageLog"]

log = logging.getLogger("outboxkit.relay")

_MAX_ERROR_CHARS = 300
#: Failed events remembered by id, to count those waiting; past it the count says "+".
_MAX_WAITING = 100_000
_SUCCESS = PublishResult.success()


class OutageLog(RelayObserver):
    """Tracks whether publishing is failing and says so a few times, not once per event.

    An outage starts at the first failed publish (to be retried, handed back or
    dead-lettered) and ends once a batch has published and nothing has failed for
    ``recover_after`` seconds. While it lasts, a reminder with counts is logged every
    ``remind_every`` seconds.
    """

    def __init__(
        self,
        *,
        max_attempts: int | None = None,
        remind_every: float = 30.0,
        recover_after: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_attempts = max_attempts
        self.remind_every = remind_every
        self.recover_after = recover_after
        self._clock = clock
        self.started_at: float | None = None
        # Events that failed and were neither published nor dead-lettered since (bounded).
        self._waiting: set[object] = set()
        self._waiting_overflow = False
        self._last_failure = self._last_report = 0.0
        self._succeeded_since_failure = False
        self._cause = ""
        self._failed = self._dead = self._delayed = 0  # since the outage started
        self._failed_since_report = 0

    @property
    def failing(self) -> bool:
        return self.started_at is not None

    @property
    def waiting(self) -> int:
        """Events that failed and wait for another try (at least, past the bound)."""
        return len(self._waiting)

    def claimed(self, count: int, seconds: float) -> None:
        if self.started_at is not None:
            self._tick(self._clock())

    def processed(
        self, messages: Sequence[OutboundMessage], results: Sequence[PublishResult], seconds: float
    ) -> None:
        if self.started_at is None and not self._waiting and _all_ok(results):
            return  # the steady state: one C-level pass, no clock read
        now = self._clock()
        waiting = self._waiting
        first: tuple[OutboundMessage, PublishResult] | None = None
        failed = dead = 0
        for message, result in zip(messages, results, strict=False):
            if result.ok:
                if waiting:  # the common case (nothing failed) costs no lookup
                    waiting.discard(message.event_id)
                continue
            failed += 1
            first = first or (message, result)
            if self._is_final(message, result):
                dead += 1
                waiting.discard(message.event_id)
            elif message.event_id not in waiting:
                if len(waiting) < _MAX_WAITING:
                    waiting.add(message.event_id)
                    self._delayed += 1
                else:
                    self._waiting_overflow = True
        if failed < len(results):
            self._succeeded_since_failure = True
        if first is not None:
            self._on_failures(now, first, failed, dead)
        self._tick(now)

    def _is_final(self, message: OutboundMessage, result: PublishResult) -> bool:
        if not result.retryable:
            return True
        return (
            result.counts_attempt
            and self.max_attempts is not None
            and message.attempt >= self.max_attempts
        )

    def _on_failures(
        self, now: float, first: tuple[OutboundMessage, PublishResult], failed: int, dead: int
    ) -> None:
        message, result = first
        error, cls = result.error or "", result.error_class or "error"
        cause = error if error.startswith(cls) else f"{cls}: {error}"
        self._cause = redact(cause)[:_MAX_ERROR_CHARS]
        self._last_failure = now
        self._succeeded_since_failure = False
        if self.started_at is None:
            self.started_at = self._last_report = now
            self._failed = self._dead = self._failed_since_report = 0
            self._delayed = len(self._waiting)
            log.warning(
                "publishing failing: %s (topic=%s); events are retried with backoff, a reminder"
                " every %.0fs and a line when it recovers (each failure is logged at DEBUG)",
                self._cause,
                message.topic,
                self.remind_every,
                extra={"outage": "started", "error_class": result.error_class},
            )
        self._failed += failed
        self._failed_since_report += failed
        self._dead += dead

    def _waiting_text(self) -> str:
        return f"{len(self._waiting)}{'+' if self._waiting_overflow else ''}"

    def _tick(self, now: float) -> None:
        if self.started_at is None:
            return
        if self._succeeded_since_failure and now - self._last_failure >= self.recover_after:
            self._recovered()
        elif now - self._last_report >= self.remind_every:
            self._last_report = now
            log.warning(
                "publishing still failing after %.0fs: %d failed publishes in the last %.0fs,"
                " %s events waiting for a retry; last error: %s",
                now - self.started_at,
                self._failed_since_report,
                self.remind_every,
                self._waiting_text(),
                self._cause,
                extra={
                    "outage": "ongoing",
                    "failed_publishes": self._failed_since_report,
                    "waiting": len(self._waiting),
                },
            )
            self._failed_since_report = 0

    def _recovered(self) -> None:
        assert self.started_at is not None
        lasted = self._last_failure - self.started_at
        if not self._waiting:
            self._waiting_overflow = False
        log.info(
            "publishing recovered after %.0fs: %d failed publishes, %d dead-lettered,"
            " %d events delayed%s",
            lasted,
            self._failed,
            self._dead,
            self._delayed,
            f"; {self._waiting_text()} still waiting for a retry" if self._waiting else "",
            extra={
                "outage": "ended",
                "outage_s": round(lasted, 3),
                "failed_publishes": self._failed,
                "dead_lettered": self._dead,
                "delayed": self._delayed,
            },
        )
        self.started_at = None


def _all_ok(results: Sequence[PublishResult]) -> bool:
    # Publishers return the shared success value; list.count compares by identity first.
    return results.count(_SUCCESS) == len(results)
