"""The in-memory queue store under the real claim loop, and what only it has (no database).

The store's rules are proven against PostgreSQL's by tests/contract/; here the queue core
(outboxkit.queue.loop.ClaimLoop, the relay's publisher sink, decide()) runs on it in one
process, as the relay runs on PostgreSQL: publish everything once, retry and dead-letter,
wake on writes (no polling), survive an outage, release at shutdown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.queue.decide import RetryPolicy
from outboxkit.queue.loop import ClaimLoop, LoopOptions
from outboxkit.queue.memory import ManualClock, MemoryQueue, MemoryQueueStore, Status
from outboxkit.queue.store import HeadsOnly, StoreUnavailable
from outboxkit.sink.observer import RelayObserver
from outboxkit.sink.publisher import PublisherSink
from tests.support.relaying import wait_for

Verdict = Callable[[OutboundMessage], PublishResult]


def message(n: int) -> OutboundMessage:
    return OutboundMessage(
        uuid.uuid4(), "t", None, "e", None, None, str(n).encode(), {}, dt.datetime.now(dt.UTC)
    )


def with_attempt(value: OutboundMessage, attempt: int) -> OutboundMessage:
    return dataclasses.replace(value, attempt=attempt)


class ListPublisher:
    """Records every message it confirms; ``verdict`` decides each one's fate."""

    name = "list"

    def __init__(self, verdict: Verdict = lambda _m: PublishResult.success()) -> None:
        self.verdict = verdict
        self.confirmed: list[int] = []
        self.hold = asyncio.Event()
        self.hold.set()

    async def start(self) -> None:
        pass

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        await self.hold.wait()
        results = [self.verdict(m) for m in messages]
        self.confirmed += [int(m.payload) for m, r in zip(messages, results, strict=True) if r.ok]
        return results

    async def close(self) -> None:
        pass


@dataclasses.dataclass
class Running:
    queue: MemoryQueue[OutboundMessage]
    publisher: ListPublisher
    loop: ClaimLoop[OutboundMessage, PublishResult]


@pytest.fixture
async def running(request: pytest.FixtureRequest) -> AsyncIterator[Running]:
    """A claim loop on a memory queue that only wake-ups can move: it polls every 60 s
    (or every ``request.param`` seconds, parametrised indirectly)."""
    poll_interval: float = getattr(request, "param", 60.0)
    queue: MemoryQueue[OutboundMessage] = MemoryQueue()
    publisher = ListPublisher()
    options = LoopOptions(
        owner="relay-a",
        batch_size=50,
        max_in_flight=2,
        lease=10.0,
        poll_interval=poll_interval,
        linger=0.01,
        listen=True,
        shutdown_timeout=0.5,
        retry=RetryPolicy(max_attempts=3, base=0.01, cap=0.02),
    )
    loop: ClaimLoop[OutboundMessage, PublishResult] = ClaimLoop(
        MemoryQueueStore(queue, with_attempt),
        PublisherSink(publisher, timeout=5.0),
        RelayObserver(),
        options,
    )
    task = asyncio.create_task(loop.run())
    await asyncio.sleep(0.05)  # idle: the gate closed, the loop waits for a wake-up
    try:
        yield Running(queue, publisher, loop)
    finally:
        loop.stop()
        await asyncio.wait_for(task, timeout=10)


async def test_the_claim_loop_publishes_every_write_once_woken_by_the_writes(
    running: Running,
) -> None:
    for start in range(0, 300, 30):
        running.queue.put_many(message(n) for n in range(start, start + 30))
        await asyncio.sleep(0.005)
    await wait_for(lambda: len(running.publisher.confirmed) >= 300, timeout=10, what="300")
    assert sorted(running.publisher.confirmed) == list(range(300))
    await wait_for(lambda: len(running.queue) == 0, timeout=5, what="the queue emptied")


async def test_a_write_from_another_thread_wakes_the_loop(running: Running) -> None:
    writer = threading.Thread(target=lambda: running.queue.put(message(7)))
    writer.start()
    writer.join()
    await wait_for(lambda: running.publisher.confirmed == [7], timeout=5, what="the write")


# A retry is due later with no write to wake the loop: the poll finds it (as on PostgreSQL).
@pytest.mark.parametrize("running", [0.02], indirect=True)
async def test_failing_items_are_retried_then_dead_lettered(running: Running) -> None:
    running.publisher.verdict = lambda m: (
        PublishResult.retry("nope") if int(m.payload) % 5 == 0 else PublishResult.success()
    )
    ids = running.queue.put_many(message(n) for n in range(20))
    failing = ids[::5]

    def dead() -> bool:
        return all(
            (row := running.queue.row(i)) is not None and row.status is Status.FAILED
            for i in failing
        )

    await wait_for(dead, timeout=10, what="the failing items dead-lettered")
    assert sorted(running.publisher.confirmed) == [n for n in range(20) if n % 5]
    assert [r.id for r in running.queue.rows()] == failing
    assert {(r.attempts, r.last_error) for r in running.queue.rows()} == {(3, "nope")}


async def test_the_loop_rides_out_an_outage_of_the_store(running: Running) -> None:
    running.queue.unavailable = True
    running.queue.put_many(message(n) for n in range(10))
    await asyncio.sleep(0.3)
    assert running.publisher.confirmed == []
    running.queue.unavailable = False  # the loop retries its claim by itself
    await wait_for(
        lambda: sorted(running.publisher.confirmed) == list(range(10)),
        timeout=10,
        what="everything published after the outage",
    )


async def test_stopping_releases_what_was_not_published(running: Running) -> None:
    running.publisher.hold.clear()  # the broker never answers
    ids = running.queue.put_many(message(n) for n in range(5))
    await wait_for(
        lambda: all((r := running.queue.row(i)) and r.claim_token for i in ids),
        timeout=5,
        what="the items claimed",
    )
    running.loop.stop()
    await wait_for(
        lambda: all((r := running.queue.row(i)) and r.claim_token is None for i in ids),
        timeout=5,
        what="the items released",
    )
    assert {(r.status, r.attempts) for r in running.queue.rows()} == {(Status.PENDING, 0)}
    running.publisher.hold.set()


# -- what the memory store has of its own ----------------------------------------------------


async def test_an_unavailable_queue_fails_every_operation_and_loses_the_gate() -> None:
    queue: MemoryQueue[OutboundMessage] = MemoryQueue()
    store = MemoryQueueStore(queue, with_attempt)
    assert await store.close_gate()
    queue.unavailable = True
    with pytest.raises(StoreUnavailable, match="MemoryQueue.unavailable"):
        await store.claim(limit=1, lease=1, token=uuid.uuid4(), owner="r", max_attempts=3)
    assert not store.gate_closed


async def test_ordered_claims_need_an_ordered_queue_and_store() -> None:
    with pytest.raises(ConfigurationError, match="partitions"):
        MemoryQueueStore(MemoryQueue(), with_attempt, ordered=True)
    store = MemoryQueueStore(MemoryQueue[OutboundMessage](partitions=4), with_attempt)
    with pytest.raises(ConfigurationError, match="ordered=True"):
        await store.claim(
            limit=1, lease=1, token=uuid.uuid4(), owner="r", max_attempts=3, policy=HeadsOnly()
        )


def test_a_manual_clock_only_goes_forward() -> None:
    clock = ManualClock(5.0)
    clock.advance(2.5)
    assert clock() == 7.5
    with pytest.raises(ValueError, match="does not go back"):
        clock.advance(-1)
