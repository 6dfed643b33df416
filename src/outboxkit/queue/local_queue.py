"""The claim loop's split path (task mode): a claim's items run one by one, settle in groups.

A split claim takes up to one item per free slot plus a prefetch; its items wait in a
local queue (graphile-worker's ``localQueue``) that a fixed set of runners, one per slot,
pull from. What costs per claim, not per item: one lease heartbeat covers the claim's
items not yet settled (queued ones too), fenced by its token; a runner is a coroutine that
lives as long as the loop, not a task per item. Finished items settle in groups as they
finish (group commit): the first at once, those finishing while a group is written in the
next one, one settle per claim in the group. A slow item never holds a fast one's settle
(it joins a group only once it has finished), and a runner is free for the next item as
soon as its handler returns, not after the settle's round trip.

When a heartbeat finds a claim's leases no longer all held it asks item by item, once,
which are gone: a running one is reported (the worker stops its handler), a queued one is
not started (its settle, fenced, reports the lost lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from outboxkit.queue.decide import Outcome
from outboxkit.queue.heartbeat import LeaseHeartbeat
from outboxkit.queue.settling import Settling
from outboxkit.queue.store import Attempted, Claim, StoreError

T = TypeVar("T", bound=Attempted)
R = TypeVar("R", bound=Outcome)

#: The error a queued item is settled with when a heartbeat found its lease gone before
#: it started (the settle is fenced: it changes nothing and reports the lost lease).
LOST_BEFORE_START = "its lease was lost before it started"


class _Sink(Protocol):
    """What the runners call of ``queue.loop.Sink``."""

    async def process(self, token: Any, items: Sequence[Any]) -> Sequence[Any]: ...

    def dead_outcome(self, error: str, error_class: str) -> Any: ...


class _Observer(Protocol):
    """What the runners call of ``queue.loop.QueueObserver``."""

    def processing(self, items: Sequence[Any]) -> contextlib.AbstractContextManager[None]: ...

    def processed(self, items: Sequence[Any], outcomes: Sequence[Any], seconds: float) -> None: ...


class _Batch(Generic[T]):
    """One claim in the local queue: which of its items are still open (not settled or
    handed back), how many have started, and its heartbeat."""

    __slots__ = ("claim", "gone", "heartbeat", "left", "open", "started")

    def __init__(self, claim: Claim[T]) -> None:
        self.claim = claim
        self.open = [True] * len(claim.ids)
        self.left = len(claim.ids)
        self.started = 0  # items start in the claim's order: those below have started
        self.gone: set[int] | None = None  # queued items whose lease a heartbeat found lost
        self.heartbeat: LeaseHeartbeat | None = None

    def part(self, indexes: Sequence[int]) -> Claim[T]:
        """The claim narrowed to ``indexes`` (the claim itself when it is all of them)."""
        claim = self.claim
        if len(indexes) == len(claim.ids):
            return claim
        ids, items = claim.ids, claim.items
        part: Claim[T] = Claim(claim.token, [ids[i] for i in indexes], [items[i] for i in indexes])
        part.claimed_at = claim.claimed_at
        return part


class LocalQueue(Generic[T, R]):
    """The split path's items between their claim and their settle (see the module).

    ``extend(claim)``: one lease extension, fenced (how many it held; None: it failed and
    was reported). ``lease_lost(claim)``: a one-item claim whose lease is gone while it
    runs. ``room()``: called when the claim loop may have room to claim again.
    ``fail(what, exc)``: an error that stops the loop.
    """

    def __init__(
        self,
        sink: _Sink,
        observer: _Observer,
        settling: Settling[T, R],
        *,
        slots: int,
        lease: float,
        name: str,
        extend: Callable[[Claim[T]], Awaitable[int | None]],
        lease_lost: Callable[[Claim[T]], None] | None,
        fail: Callable[[str, BaseException], None],
        log: logging.Logger,
        track_run_time: bool,
    ) -> None:
        self.sink = sink
        self.observer = observer
        self.settling = settling
        self.slots = slots
        self.lease = lease
        self.name = name
        self._extend = extend
        self._lease_lost = lease_lost
        self._fail = fail
        self.log = log
        self._track = track_run_time
        #: Items claimed and not yet settled or handed back (queued, running, settling).
        self.held = 0
        #: Items running now.
        self.running = 0
        #: An item's run time, smoothed (None: none ran yet): the prefetch's measure.
        self.run_time: float | None = None
        #: Set when the claim loop may claim again (an item started, a group settled).
        self.room = asyncio.Event()
        self._queue: deque[tuple[_Batch[T], int]] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()  # runners waiting for an item
        self._finished: list[tuple[_Batch[T], int, R]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._flushes: set[asyncio.Task[None]] = set()
        self._runners: list[asyncio.Task[None]] = []
        self._open: set[_Batch[T]] = set()  # claims with items not yet settled
        self._closing = False

    @property
    def queued(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._runners = [
            asyncio.create_task(self._runner(), name=f"{self.name}:runner")
            for _ in range(self.slots)
        ]

    def add(self, claim: Claim[T]) -> None:
        """Queue ``claim``'s items for the runners; its heartbeat starts now."""
        batch: _Batch[T] = _Batch(claim)
        batch.heartbeat = LeaseHeartbeat(
            lambda: self._heartbeat(batch), self.lease / 3, name=self.name
        )
        batch.heartbeat.start()
        self._open.add(batch)
        self.held += len(claim.ids)
        self._queue.extend([(batch, i) for i in range(len(claim.ids))])
        idle = self._idle
        for _ in range(min(len(idle), len(claim.ids))):
            waiter = idle.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # -- the runners ---------------------------------------------------------------------

    async def _runner(self) -> None:
        queue, loop = self._queue, asyncio.get_running_loop()
        sink, observer = self.sink, self.observer
        while True:
            if not queue:
                if self._closing:
                    return
                waiter: asyncio.Future[None] = loop.create_future()
                self._idle.append(waiter)
                await waiter
                continue
            batch, i = queue.popleft()
            batch.started = i + 1
            if len(queue) <= self.slots:
                self.room.set()
            claim = batch.claim
            one = (claim.items[i],)
            if batch.gone is not None and i in batch.gone:
                self._finished_one(batch, i, sink.dead_outcome(LOST_BEFORE_START, "LeaseLost"))
                continue
            self.running += 1
            try:
                with observer.processing(one):
                    started = time.perf_counter()
                    outcome = (await sink.process(claim.token, one))[0]
                    seconds = time.perf_counter() - started
                    observer.processed(one, (outcome,), seconds)
            except asyncio.CancelledError:
                # Forced shutdown mid-run: hand the item back now, not at lease expiry.
                await asyncio.shield(self._release(batch, [i]))
                raise
            except BaseException as exc:  # a sink that raises fails the loop
                self._fail("batch", exc)
                return
            finally:
                self.running -= 1
            if self._track:
                last = self.run_time
                self.run_time = seconds if last is None else 0.8 * last + 0.2 * seconds
            self._finished_one(batch, i, outcome)

    # -- the grouped settle --------------------------------------------------------------

    def _finished_one(self, batch: _Batch[T], i: int, outcome: R) -> None:
        self._finished.append((batch, i, outcome))
        if self._flusher is None:
            # A task per group, not per item: it runs once the runners finishing in this
            # turn of the event loop have joined.
            flusher = asyncio.create_task(self._flush(), name=f"{self.name}:settle")
            self._flusher = flusher
            self._flushes.add(flusher)
            flusher.add_done_callback(self._flush_done)

    def _flush_done(self, task: asyncio.Task[None]) -> None:
        self._flushes.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._fail("settle", exc)

    async def _flush(self) -> None:
        try:
            while self._finished:
                finished, self._finished = self._finished, []
                groups: dict[int, tuple[_Batch[T], list[int], list[R]]] = {}
                for batch, i, outcome in finished:
                    group = groups.get(id(batch))
                    if group is None:
                        groups[id(batch)] = (batch, [i], [outcome])
                    else:
                        group[1].append(i)
                        group[2].append(outcome)
                if len(groups) == 1:
                    await self._settle(*next(iter(groups.values())))
                else:  # together: the store writes them in one statement where it can
                    await asyncio.gather(*(self._settle(*g) for g in groups.values()))
        finally:
            self._flusher = None

    async def _settle(self, batch: _Batch[T], indexes: list[int], outcomes: list[R]) -> None:
        part = batch.part(indexes)
        try:
            await self.settling.settle(part, outcomes)
        except StoreError as exc:
            self.settling.failed(exc)
        except asyncio.CancelledError:
            await asyncio.shield(self.settling.release(part))
            raise
        finally:
            await self._close(batch, indexes)

    async def _release(self, batch: _Batch[T], indexes: list[int]) -> None:
        try:
            await self.settling.release(batch.part(indexes))
        finally:
            await self._close(batch, indexes)

    async def _close(self, batch: _Batch[T], indexes: list[int]) -> None:
        """These items are settled or handed back: no longer held, heartbeat or slot."""
        still = batch.open
        closed = 0
        for i in indexes:
            if still[i]:
                still[i] = False
                closed += 1
        batch.left -= closed
        self.held -= closed
        self.room.set()
        if batch.left == 0:
            await self._forget(batch)

    async def _forget(self, batch: _Batch[T]) -> None:
        self._open.discard(batch)
        if batch.heartbeat is not None:
            heartbeat, batch.heartbeat = batch.heartbeat, None
            await heartbeat.stop()

    # -- the heartbeat -------------------------------------------------------------------

    async def _heartbeat(self, batch: _Batch[T]) -> None:
        """Extend the open items' leases; if some are gone, find which, once per loss."""
        indexes = [i for i, o in enumerate(batch.open) if o]
        if not indexes:
            return
        part = batch.part(indexes)
        held = await self._extend(part)
        if held is None or held >= len(indexes):
            return
        for i in indexes:  # rare: an operator's cancel, or a re-claim after a freeze
            if not batch.open[i]:
                continue
            one = batch.part([i])
            if await self._extend(one) != 0 or not batch.open[i]:
                continue
            if i >= batch.started:  # queued: not started at all
                if batch.gone is None:
                    batch.gone = set()
                batch.gone.add(i)
            elif self._lease_lost is not None:
                self._lease_lost(one)

    # -- shutdown ------------------------------------------------------------------------

    async def drain(self, grace: float) -> None:
        """Hand back what has not started (refunded, at once), let the running items finish
        within ``grace`` seconds (hand them back past it), then write their settles."""
        self._closing = True
        queued = list(self._queue)
        self._queue.clear()  # (the runners hold this deque)
        while self._idle:
            waiter = self._idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
        by_batch: dict[int, tuple[_Batch[T], list[int]]] = {}
        for batch, i in queued:
            by_batch.setdefault(id(batch), (batch, []))[1].append(i)
        if by_batch:
            await asyncio.shield(
                asyncio.gather(*(self._release(b, ix) for b, ix in by_batch.values()))
            )
        deadline = time.monotonic() + grace
        runners = [r for r in self._runners if not r.done()]
        if runners:
            _done, still = await asyncio.wait(runners, timeout=grace)
            for runner in still:
                runner.cancel()
            await asyncio.gather(*runners, return_exceptions=True)
        # The settles of what finished: past the timeout they get one lease more (the
        # settle itself gives up at shutdown when the database is unreachable).
        flushes = set(self._flushes)
        if flushes:
            wait = max(deadline - time.monotonic(), 0.0) + self.lease
            _done, still = await asyncio.wait(flushes, timeout=wait)
            for flush in still:
                flush.cancel()
            await asyncio.gather(*flushes, return_exceptions=True)
        # What no settle took (its flush cancelled): handed back; then no heartbeat outlives
        # the loop (a settle given up at shutdown leaves its items to their lease).
        left: dict[int, tuple[_Batch[T], list[int]]] = {}
        for batch, i, _outcome in self._finished:
            left.setdefault(id(batch), (batch, []))[1].append(i)
        self._finished = []
        if left:
            await asyncio.gather(
                *(self._release(b, ix) for b, ix in left.values()), return_exceptions=True
            )
        for batch in list(self._open):
            await self._forget(batch)
