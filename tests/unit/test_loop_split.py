"""The claim loop's split option (task mode): one claim statement, one slot per item. No server."""

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

    async def start(self) -> StoreInfo:
        return StoreInfo(len(self.pending))

    async def claim(self, *, limit: int, token: uuid.UUID, **_: Any) -> Claim[Item] | None:
        self.limits.append(limit)
        ids, self.pending = self.pending[:limit], self.pending[limit:]
        return Claim(token, ids, [Item() for _ in ids]) if ids else None

    async def settle(self, claim: Claim[Item], decisions: Sequence[Decision]) -> Settled:
        self.settled.append(list(claim.ids))
        return Settled(claim.ids)

    async def extend_leases(self, claim: Claim[Item], lease: float) -> int:
        return len(claim.ids)

    async def release(self, claim: Claim[Item]) -> int:
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
        self.release = asyncio.Event()

    async def process(self, token: uuid.UUID, items: Sequence[Item]) -> Sequence[Ok]:
        self.calls.append(len(items))
        await self.release.wait()
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


def test_a_split_claim_takes_one_item_per_free_slot_and_runs_each_alone() -> None:
    store, sink = Store(7), Sink()
    options = LoopOptions(
        owner="t", batch_size=4, max_in_flight=4, lease=30.0, poll_interval=0.01, linger=0.0,
        listen=False, shutdown_timeout=1.0, retry=RetryPolicy(), split=True,
    )  # fmt: skip
    loop: ClaimLoop[Item, Ok] = ClaimLoop(store, sink, Observer(), options)  # type: ignore[arg-type]

    async def main() -> None:
        running = asyncio.create_task(loop.run())
        while len(sink.calls) < 4:
            await asyncio.sleep(0.001)
        assert store.limits == [4]  # one statement claimed a task for every free slot
        sink.release.set()
        while len(store.settled) < 7:
            await asyncio.sleep(0.001)
        loop.stop()
        await running

    asyncio.run(main())
    assert sink.calls == [1] * 7
    assert sorted(i for ids in store.settled for i in ids) == list(range(1, 8))
    assert all(len(ids) == 1 for ids in store.settled)
