"""When the claim loop looks again: the linger's waits after work, the gather window's
figures and the retry of a wake-up gate a writer holds open (queue/loop.py's waits)."""

from __future__ import annotations

# While a writer holds the wake-up gate open (between its INSERT and its COMMIT), a loop
# with nothing to do looks again after this long, doubling up to the second figure.
GATE_RETRY = (0.005, 0.1)
# A loop that found work looks again after this long (then twice as long, ...): at a
# steady 1 000 events/s, 1 ms gave 1.9 events per claim and 2 ms 3.0, for a third less
# relay CPU per event at +0.5 ms p50 (bench/concurrent_writers.py --latency-only).
FIRST_LOOK = 0.002
# The gather window's goal: a look after work waits until about this many items are due
# (never longer than the window); items arriving slower than 2 a window get no wait at all.
GATHER_ITEMS = 32
GATHER_MIN_ITEMS = 2.0
# How much each claim moves the arrival-rate estimate (an exponential moving average).
RATE_WEIGHT = 0.3


def linger_waits(
    linger: float, first: float = FIRST_LOOK, longest: float | None = None
) -> tuple[float, ...]:
    """``first``, then doubling (2, 4, 8, ... ms, at most ``longest``) until they add up to
    ``linger``."""
    waits: list[float] = []
    wait, total = first, 0.0
    while total < linger - 1e-9:
        step = min(wait, linger - total)
        waits.append(step)
        total += step
        wait = wait * 2 if longest is None else min(wait * 2, longest)
    return tuple(waits)
