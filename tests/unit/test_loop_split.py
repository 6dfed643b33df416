"""The claim loop's split option (task mode): one claim statement, one slot per item, settles
in groups as items finish, one heartbeat per claim. No server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from outboxkit.queue.decide import RetryPolicy
from outboxkit.queue.loop import ClaimLoop, LoopOptions
from outboxkit.queue.store import Claim, Decision, Settled, StoreInfo


@dataclass
class Item:
    attempt: int = 1


@dataclass(frozen=True)
class Ok:
    ok: bool = True
    error: str | None = None
    retryable: bool = True
    retry_after: float | None = None
    counts_attempt: bool = True


class Store:
    def __init__(self, count: int) -> None:
        self.pending = list(range(1, count + 1))
        self.limits: list[int] = []
        self.settled: list[list[int]] = []
        self.released: list[list[int]] = []
        self.extended: list[list[int]] = []
        self.gone: set[int] = set()  # leases lost (re-claimed elsewhere)
        self.settle_gate: asyncio.Event | None = None  # set: settles go through

    async def start(self) -> StoreInfo:
        return StoreInfo(len(self.pending))

    async def claim(self, *, limit: int, token: uuid.UUID, **_: Any) -> Claim[Item] | None:
        self.limits.append(limit)
        ids, self.pending = self.pending[:limit], self.pending[limit:]
        return Claim(token, ids, [Item() for _ in ids]) if ids else None

    async def settle(self, claim: Claim[Item], decisions: Sequence[Decision]) -> Settled:
        if self.settle_gate is not None:
            await self.settle_gate.wait()
        self.settled.append(list(claim.ids))
        kept = [i for i in claim.ids if i not in self.gone]
        return Settled(kept, len(claim.ids) - len(kept))

    async def extend_leases(self, claim: Claim[Item], lease: float) -> int:
        self.extended.append(list(claim.ids))
        return sum(1 for i in claim.ids if i not in self.gone)

    async def release(self, claim: Claim[Item]) -> int:
        self.released.append(list(claim.ids))
        return len(claim.ids)

    async def hasten(self, ids: Sequence[int]) -> int:
        return 0

    async def close_gate(self) -> bool:
        return False

    async def open_gate(self) -> None:
        pass

    gate_closed = False
    can_listen = False

    async def listen(self, wake: Callable[[], None]) -> None:
        pass

    async def close(self) -> None:
        pass


class Sink:
    name = "test"

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.started: list[int] = []  # item ids, in the order they started
        self.release = asyncio.Event()
        self.slow: dict[int, asyncio.Event] = {}  # item id -> released on its own
        self.items: dict[int, Item] = {}

    async def process(self, token: uuid.UUID, items: Sequence[Item]) -> Sequence[Ok]:
        self.calls.append(len(items))
        item_id = next(i for i, m in self.items.items() if m is items[0]) if self.items else 0
        self.started.append(item_id)
        await self.slow.get(item_id, self.release).wait()
        return [Ok() for _ in items]

    def target_down(self) -> bool:
        return False

    def restored_since(self, when: float) -> bool:
        return False

    def dead_outcome(self, error: str, error_class: str) -> Ok:
        return Ok(False, error)


class Observer:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None

    @contextmanager
    def processing(self, messages: Sequence[Item]) -> Iterator[None]:
        yield


def _options(slots: int, batch: int, **kwargs: Any) -> LoopOptions:
    base: dict[str, Any] = {
        "owner": "t", "batch_size": batch, "max_in_flight": slots, "lease": 30.0,
        "poll_interval": 0.01, "linger": 0.0, "listen": False, "shutdown_timeout": 1.0,
        "retry": RetryPolicy(), "split": True,
    }  # fmt: skip
    return LoopOptions(**{**base, **kwargs})


class _IdStore(Store):
    """Items that remember their ids (the sink tells which item runs)."""

    def __init__(self, count: int, sink: Sink) -> None:
        super().__init__(count)
        self.sink = sink

    async def claim(self, *, limit: int, token: uuid.UUID, **_: Any) -> Claim[Item] | None:
        claim = await super().claim(limit=limit, token=token)
        if claim is not None:
            self.sink.items.update(zip(claim.ids, claim.items, strict=True))
        return claim


async def _until(check: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.001)


def test_a_split_claim_takes_a_task_per_free_slot_runs_each_alone_settles_in_groups() -> None:
    store, sink = Store(7), Sink()
    loop: ClaimLoop[Item, Ok] = ClaimLoop(store, sink, Observer(), _options(4, 4))  # type: ignore[arg-type]

    async def main() -> None:
        running = asyncio.create_task(loop.run())
        await _until(lambda: len(sink.calls) == 4, "four running")
        assert store.limits == [4]  # one statement claimed a task for every free slot
        sink.release.set()
        await _until(lambda: sum(map(len, store.settled)) == 7, "all settled")
        loop.stop()
        await running

    asyncio.run(main())
    assert sink.calls == [1] * 7  # each item ran on its own
    assert sorted(i for ids in store.settled for i in ids) == list(range(1, 8))
    # The four that finished together settled together: fewer settles than items.
    assert len(store.settled) < 7
    assert [1, 2, 3, 4] in store.settled


def test_a_slow_item_never_holds_the_settle_of_the_fast_ones_claimed_with_it() -> None:
    sink = Sink()
    store = _IdStore(6, sink)
    sink.slow[1] = asyncio.Event()  # (bound to the loop at first wait)
    loop: ClaimLoop[Item, Ok] = ClaimLoop(store, sink, Observer(), _options(6, 6))  # type: ignore[arg-type]

    async def main() -> None:
        running = asyncio.create_task(loop.run())
        sink.release.set()
        await _until(lambda: sum(map(len, store.settled)) == 5, "the fast ones settled")
        assert 1 not in {i for ids in store.settled for i in ids}  # still running
        assert loop.status().in_flight == 1
        sink.slow[1].set()
        await _until(lambda: sum(map(len, store.settled)) == 6, "the slow one settled")
        loop.stop()
        await running

    asyncio.run(main())


def test_a_runner_takes_the_next_item_while_the_last_ones_settle_is_written() -> None:
    """A slot frees when its handler returns, not after the settle's round trip: with the
    settle stalled, the prefetched items all run on the 2 runners."""
    store, sink = Store(8), Sink()
    store.settle_gate = asyncio.Event()
    sink.release.set()
    loop: ClaimLoop[Item, Ok] = ClaimLoop(
        store,
        sink,
        Observer(),
        _options(2, 10, prefetch=8),  # type: ignore[arg-type]
    )

    async def main() -> None:
        running = asyncio.create_task(loop.run())
        await _until(lambda: len(sink.calls) == 8, "every item ran")
        assert store.settled == []  # (all waiting for the first settle)
        assert store.settle_gate is not None
        store.settle_gate.set()
        await _until(lambda: sum(map(len, store.settled)) == 8, "all settled")
        loop.stop()
        await running

    asyncio.run(main())
    assert len(store.settled) <= 3  # the first group, then the rest together


def test_one_heartbeat_per_claim_finds_which_leases_are_gone() -> None:
    """The heartbeat extends a claim's open items in one statement; when some are gone it
    asks item by item: the running one is reported, the queued one never starts."""
    sink = Sink()
    store = _IdStore(3, sink)
    lost: list[list[int]] = []
    sink.slow[2] = asyncio.Event()
    loop: ClaimLoop[Item, Ok] = ClaimLoop(
        store,  # type: ignore[arg-type]
        sink,
        Observer(),  # type: ignore[arg-type]
        _options(1, 3, lease=0.3, prefetch=2),
        on_lease_lost=lambda claim, held: lost.append([*claim.ids, held]),
    )

    async def main() -> None:
        running = asyncio.create_task(loop.run())
        sink.release.set()
        # No prefetch before an item ran: the first claim takes one, the next the rest.
        await _until(lambda: sink.started == [1, 2], "the second running, the third queued")
        store.gone.update({2, 3})  # (re-claimed elsewhere after a freeze, say)
        await _until(lambda: [2, 3] in store.extended, "a heartbeat")
        # One statement for the claim's open items, then one per item to find which.
        await _until(lambda: bool(lost), "the running one reported")
        assert lost == [[2, 0]]
        assert store.extended[store.extended.index([2, 3]) :][:3] == [[2, 3], [2], [3]]
        sink.slow[2].set()
        await _until(lambda: sum(map(len, store.settled)) == 3, "all settled (fenced)")
        loop.stop()
        await running

    asyncio.run(main())
    assert sink.started == [1, 2]  # the queued item whose lease was gone never ran


def test_stopping_hands_the_queued_items_back_at_once_and_lets_the_running_finish() -> None:
    sink = Sink()
    store = _IdStore(5, sink)
    for i in (1, 2):
        sink.slow[i] = asyncio.Event()
    loop: ClaimLoop[Item, Ok] = ClaimLoop(
        store,
        sink,
        Observer(),
        _options(2, 5, prefetch=3, shutdown_timeout=5.0),  # type: ignore[arg-type]
    )
    loop._local.run_time = 0.001  # type: ignore[union-attr]  # (as if items had run)

    async def main() -> None:
        running = asyncio.create_task(loop.run())
        await _until(lambda: sink.started == [1, 2], "two running, three queued")
        assert store.limits == [5]
        loop.stop()
        await _until(lambda: store.released == [[3, 4, 5]], "the queued handed back")
        assert store.settled == []
        sink.slow[1].set()
        sink.slow[2].set()
        await running

    asyncio.run(main())
    assert sorted(i for ids in store.settled for i in ids) == [1, 2]
    assert sink.started == [1, 2]


def test_a_settle_stuck_past_the_drain_hands_back_and_no_heartbeat_outlives_it() -> None:
    store, sink = Store(2), Sink()
    store.settle_gate = asyncio.Event()  # never set: the settle hangs
    sink.release.set()
    loop: ClaimLoop[Item, Ok] = ClaimLoop(
        store,
        sink,
        Observer(),
        _options(2, 2, lease=0.3, shutdown_timeout=0.1),  # type: ignore[arg-type]
    )

    async def main() -> None:
        running = asyncio.create_task(loop.run())
        await _until(lambda: len(sink.calls) == 2, "both ran")
        await asyncio.sleep(0.15)  # (a heartbeat or so while the settle hangs)
        loop.stop()
        await running
        assert sorted(i for ids in store.released for i in ids) == [1, 2]
        extended = len(store.extended)
        await asyncio.sleep(0.4)  # past a heartbeat's interval
        assert len(store.extended) == extended

    asyncio.run(main())
    assert store.settled == []
