"""The claim loop (outboxkit.queue.loop) on a store and a sink in memory: no server at all.

A stand-in for the store interface (the contract suite proves the real backends), enough to
show what the loop itself decides: settle what the sink reports, make what an outage handed
back due once the target is back, stop claiming while the store refuses its settles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from outboxkit.errors import StoreDenied
from outboxkit.publishers.base import PublishResult
from outboxkit.queue.decide import RetryPolicy
from outboxkit.queue.loop import ClaimLoop, LoopOptions, linger_waits
from outboxkit.queue.store import Claim, ClaimPolicy, Decision, Settled, StoreInfo, Verdict
from outboxkit.sink.observer import RelayObserver


@dataclass
class _Item:
    name: str
    attempt: int = 1


class _Store:
    """Items due at once, claimed in order; settles recorded; a switch to refuse them."""

    def __init__(self, names: list[str]) -> None:
        self.pending = {i: _Item(n) for i, n in enumerate(names)}
        self.settled: dict[int, Verdict] = {}
        self.hastened: list[int] = []
        self.claims = 0
        self.refuse_settles = False

    async def start(self) -> StoreInfo:
        return StoreInfo(len(self.pending))

    async def claim(
        self,
        *,
        limit: int,
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
        policy: ClaimPolicy = None,
    ) -> Claim[_Item] | None:
        self.claims += 1
        ids = sorted(self.pending)[:limit]
        if not ids:
            return None
        return Claim(token, ids, [self.pending.pop(i) for i in ids])

    async def settle(self, claim: Claim[_Item], decisions: Sequence[Decision]) -> Settled:
        if self.refuse_settles:
            raise StoreDenied("permission denied for table outbox")
        for item_id, item, decision in zip(claim.ids, claim.items, decisions, strict=True):
            self.settled[item_id] = decision.verdict
            if decision.verdict is Verdict.HAND_BACK and decision.delay == 0:
                self.pending[item_id] = item
        return Settled(claim.ids)

    async def extend_leases(self, claim: Claim[_Item], lease: float) -> int:
        return len(claim.ids)

    async def release(self, claim: Claim[_Item]) -> int:
        return len(claim.ids)

    async def hasten(self, ids: Sequence[int]) -> int:
        self.hastened.extend(ids)
        return len(ids)

    async def close_gate(self) -> bool:
        return False

    async def open_gate(self) -> None:
        pass

    @property
    def gate_closed(self) -> bool:
        return False

    @property
    def can_listen(self) -> bool:
        return False

    async def listen(self, wake: Callable[[], None]) -> None:
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


class _Sink:
    """Answers each item with ``answer(item)``; ``down`` / ``back_at`` play the client's view."""

    name = "memory"

    def __init__(self, answer: Callable[[_Item], PublishResult]) -> None:
        self.answer = answer
        self.down = False
        self.back_at: float | None = None

    async def process(self, token: uuid.UUID, items: Sequence[_Item]) -> list[PublishResult]:
        return [self.answer(item) for item in items]

    def target_down(self) -> bool:
        return self.down

    def restored_since(self, when: float) -> bool:
        return self.back_at is not None and self.back_at > when

    def dead_outcome(self, error: str, error_class: str) -> PublishResult:
        return PublishResult.permanent(error, error_class)


def _loop(
    store: _Store, sink: _Sink, observer: RelayObserver | None = None
) -> ClaimLoop[_Item, PublishResult]:
    options = LoopOptions(
        owner="test",
        batch_size=10,
        max_in_flight=2,
        lease=5.0,
        poll_interval=0.01,
        linger=0.0,
        listen=False,
        shutdown_timeout=1.0,
        retry=RetryPolicy(max_attempts=3, base=0.01, cap=0.05),
    )
    # (RelayObserver's hooks are typed for messages; the no-op base reads nothing of them)
    return ClaimLoop(store, sink, observer or RelayObserver(), options)  # type: ignore[arg-type]


async def _until(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_each_item_is_settled_as_the_sink_reports_it() -> None:
    store = _Store(["ok", "bad", "ok", "never"])
    answers = {
        "ok": PublishResult.success(),
        "bad": PublishResult.permanent("rejected"),
        "never": PublishResult.retry("busy"),
    }
    loop = _loop(store, _Sink(lambda item: answers[item.name]))
    task = asyncio.create_task(loop.run())
    await _until(lambda: len(store.settled) == 4)
    loop.stop()
    await task
    assert store.settled == {0: Verdict.DONE, 1: Verdict.DEAD, 2: Verdict.DONE, 3: Verdict.RETRY}


async def test_what_an_outage_handed_back_is_made_due_once_the_target_is_back() -> None:
    store = _Store([f"e{i}" for i in range(5)])
    sink = _Sink(lambda item: PublishResult.retry("no PubAck"))
    sink.down = True
    loop = _loop(store, sink)
    task = asyncio.create_task(loop.run())
    await _until(lambda: len(store.settled) == 5)
    assert set(store.settled.values()) == {Verdict.HAND_BACK}, "an outage is not their fault"
    assert store.hastened == []
    sink.down, sink.back_at = False, asyncio.get_running_loop().time() + 1e9  # reconnected
    await _until(lambda: len(store.hastened) == 5)
    loop.stop()
    await task
    assert sorted(store.hastened) == [0, 1, 2, 3, 4]


async def test_a_refused_settle_stops_the_claiming_until_it_goes_through() -> None:
    store = _Store([f"e{i}" for i in range(3)])
    loop = _loop(store, _Sink(lambda item: PublishResult.success()))
    store.refuse_settles = True
    task = asyncio.create_task(loop.run())
    await _until(lambda: loop.status().denied is not None)
    claims = store.claims
    await asyncio.sleep(0.3)
    assert store.claims == claims, "nothing claimed while the store refuses the settles"
    store.refuse_settles = False
    await _until(lambda: len(store.settled) == 3, timeout=15.0)
    assert loop.status().denied is None
    loop.stop()
    await task


@pytest.mark.parametrize("fail", [True, False])
async def test_a_side_task_that_fails_stops_the_loop_with_its_error(fail: bool) -> None:
    async def side() -> None:
        await asyncio.sleep(0.01)
        if fail:
            raise RuntimeError("side task broke")

    store = _Store([])
    loop = _loop(store, _Sink(lambda item: PublishResult.success()))
    loop.side_tasks = [("side", side)]
    task = asyncio.create_task(loop.run())
    if fail:
        with pytest.raises(RuntimeError, match="side task broke"):
            await asyncio.wait_for(task, 3)
    else:
        await asyncio.sleep(0.1)
        assert not task.done(), "a side task that ends cleanly does not stop the loop"
        loop.stop()
        await task


def test_linger_waits_double_unless_capped() -> None:
    # The relay's: 2, 4, 8, 16 ms; the task worker's: at most 2 ms, so a commit during the
    # linger is seen within a couple of milliseconds (bench/tasks_latency.py).
    assert linger_waits(0.03) == pytest.approx((0.002, 0.004, 0.008, 0.016))
    assert linger_waits(0.01, longest=0.002) == pytest.approx((0.002,) * 5)
    assert linger_waits(0.0) == ()


def _gathering_loop(gather: float, linger: float = 0.03) -> ClaimLoop[_Item, PublishResult]:
    loop = _loop(_Store([]), _Sink(lambda item: PublishResult.success()))
    loop.options = dataclasses.replace(loop.options, linger=linger, gather=gather)
    loop._linger_waits = linger_waits(linger)
    return loop


@pytest.mark.parametrize(
    ("arrivals", "wait"),
    [
        (0.0, 0.002),  # a quiet table: the linger's first look, nothing held back
        (150.0, 0.002),  # fewer than 2 items a window: no wait would batch anything
        (500.0, 0.010),  # a steady 500/s: the whole window, about 5 items a claim
        (5000.0, 0.0064),  # 5 000/s: until about 32 items are due
        (100_000.0, 0.002),  # a flood: never below the linger's first look
    ],
)
def test_the_first_look_after_work_waits_for_more_only_while_items_arrive(
    arrivals: float, wait: float
) -> None:
    loop = _gathering_loop(0.01)
    loop._arrivals = arrivals
    assert loop._gathering() == pytest.approx(wait)
    off = _gathering_loop(0.0)  # the task worker's: off
    off._arrivals = arrivals
    assert off._gathering() == pytest.approx(0.002)


async def test_the_arrival_rate_is_learned_from_the_claims() -> None:
    """Claims that each find items a few ms apart raise the estimate; empty ones lower it."""
    loop = _gathering_loop(0.01)
    loop.options = dataclasses.replace(loop.options, batch_size=2)  # each claim finds 2
    store = loop.store = _Store([f"e{i}" for i in range(16)])  # type: ignore[assignment]
    for _ in range(8):
        await loop._claim()
        await asyncio.sleep(0.004)
    assert loop._arrivals > 200  # ~2 items every ~4 ms
    assert not store.pending
    for _ in range(8):
        await loop._claim()
        await asyncio.sleep(0.004)
    assert loop._arrivals < 30
