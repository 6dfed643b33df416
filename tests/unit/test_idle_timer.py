"""queue/idle.py's IdleTimer: what closes the idle settle connection (both backends) and parks
a fleet's idle claim connection (PostgreSQL)."""

from __future__ import annotations

import asyncio

from outboxkit.queue.idle import IdleTimer


async def test_it_expires_once_after_the_last_use_not_the_first() -> None:
    loop = asyncio.get_running_loop()
    expired: list[float] = []
    timer = IdleTimer(0.2, lambda: expired.append(loop.time()) or None)
    timer.used()
    await asyncio.sleep(0.15)
    last = loop.time()
    timer.used()  # (pushes the end back: the timer waits the rest)
    await asyncio.sleep(0.6)
    assert len(expired) == 1
    assert expired[0] - last >= 0.2 - 0.01


async def test_a_busy_connection_is_asked_again_and_an_unset_timer_never_runs() -> None:
    answers = [0.1, None]  # busy once, then closed
    calls: list[float | None] = []

    def expire() -> float | None:
        calls.append(answers[len(calls)])
        return calls[-1]

    timer = IdleTimer(0.05, expire)
    timer.used()
    await asyncio.sleep(0.4)
    assert calls == [0.1, None]

    never = IdleTimer(None, lambda: calls.append(-1.0) or None)
    never.used()
    cancelled = IdleTimer(0.05, lambda: calls.append(-2.0) or None)
    cancelled.used()
    cancelled.cancel()
    await asyncio.sleep(0.2)
    assert calls == [0.1, None]
