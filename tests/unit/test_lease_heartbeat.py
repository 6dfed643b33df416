"""LeaseHeartbeat (queue/heartbeat.py): nothing for a short publish, every interval for a
long one, and an extension in progress is finished, never cut, by stop()."""

from __future__ import annotations

import asyncio

from outboxkit.queue.heartbeat import LeaseHeartbeat


async def test_a_publish_shorter_than_the_interval_extends_nothing() -> None:
    calls: list[float] = []

    async def extend() -> None:
        calls.append(asyncio.get_running_loop().time())

    beat = LeaseHeartbeat(extend, 0.2)
    beat.start()
    await asyncio.sleep(0.05)
    await beat.stop()
    await asyncio.sleep(0.3)
    assert calls == []


async def test_a_long_publish_extends_every_interval_until_stopped() -> None:
    loop = asyncio.get_running_loop()
    calls: list[float] = []

    async def extend() -> None:
        calls.append(loop.time())

    started = loop.time()
    beat = LeaseHeartbeat(extend, 0.1)
    beat.start()
    await asyncio.sleep(0.45)
    await beat.stop()
    n = len(calls)
    await asyncio.sleep(0.25)
    assert 3 <= n <= 5 and len(calls) == n
    assert calls[0] - started >= 0.09  # the first one after one interval, not at once


async def test_stop_waits_for_an_extension_in_progress() -> None:
    finished: list[bool] = []
    running = asyncio.Event()

    async def extend() -> None:
        running.set()
        await asyncio.sleep(0.2)  # a statement on its way to the database
        finished.append(True)

    beat = LeaseHeartbeat(extend, 0.01)
    beat.start()
    await running.wait()
    await beat.stop()
    assert finished == [True]
