"""The claim loop: claim under a lease, hand the items to a sink, decide, settle. Pipelined.

No SQL and no broker here (procrastinate's worker is the model): every database action is
a :class:`~outboxkit.queue.store.QueueStore` call, every item's fate a
:func:`~outboxkit.queue.decide.decide` value, the work itself a :class:`Sink`. The relay
is this loop with a publisher sink; the task worker the same loop with a handler sink.

What it keeps: ``max_in_flight`` claims in flight (the claim of batch N+1 overlaps the work
of batch N); after work it looks again at 2 ms (longer, up to ``gather``, while items
arrive steadily: the gather window), 4, 8 ... ms for ``linger`` seconds, then
closes the store's wake-up gate (writers wake it from then on) and waits for a wake-up or
``poll_interval``; a lease heartbeat for work running past a third of the lease; side tasks
under supervision (the first one to fail stops the loop with its error); a drain on stop
(in-flight work finishes within ``shutdown_timeout`` or is released). A store that refuses
the loop's writes (:class:`StoreDenied`) stops the claiming until it accepts them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

from outboxkit._redact import redact
from outboxkit._text import first_line
from outboxkit.queue.decide import Outcome, RetryPolicy
from outboxkit.queue.heartbeat import LeaseHeartbeat
from outboxkit.queue.loop_types import (
    RELAY_WORDS,
    WORKER_WORDS,
    LoopOptions,
    LoopStatus,
    Ordering,
    QueueObserver,
    Sink,
    Wording,
    default_owner_id,
)
from outboxkit.queue.loop_wiring import LoopParts, wire_loop
from outboxkit.queue.pacing import GATE_RETRY, GATHER_ITEMS, GATHER_MIN_ITEMS, RATE_WEIGHT
from outboxkit.queue.pacing import linger_waits as linger_waits
from outboxkit.queue.side_tasks import cancel_and_capture_errors, watch_side_tasks
from outboxkit.queue.store import (
    Attempted,
    Claim,
    ClaimPolicy,
    QueueStore,
    StoreDenied,
    StoreError,
)

# (the loop's types, its options and words live in queue/loop_types.py, its waits'
# figures in queue/pacing.py; imported from here as before)
__all__ = [
    "RELAY_WORDS", "WORKER_WORDS", "ClaimLoop", "LoopOptions", "LoopStatus", "Ordering",
    "QueueObserver", "Sink", "Wording", "default_owner_id", "linger_waits",
]  # fmt: skip

T = TypeVar("T", bound=Attempted)
#: The outcome a sink reports per item (PublishResult for the relay).
R = TypeVar("R", bound=Outcome)


class ClaimLoop(Generic[T, R]):
    """Claims from ``store``, hands each claim to ``sink``, settles what :func:`decide` says."""

    def __init__(
        self,
        store: QueueStore[T],
        sink: Sink[T, R],
        observer: QueueObserver[T, R],
        options: LoopOptions,
        *,
        ordering: Ordering | None = None,
        side_tasks: Sequence[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = (),
        logger: logging.Logger | None = None,
        retry_for: Callable[[T], RetryPolicy] | None = None,
        on_lease_lost: Callable[[Claim[T], int], None] | None = None,
    ) -> None:
        self.store = store
        #: Told when a heartbeat finds the claim's items no longer all held (re-claimed
        #: elsewhere, or taken away by an operator), with how many it still holds: the
        #: task worker stops handlers whose task is gone. None: nothing to tell.
        self.on_lease_lost = on_lease_lost
        self.sink = sink
        self.observer = observer
        self.options = options
        self.ordering = ordering
        self.side_tasks = side_tasks
        self.log = logger or logging.getLogger("outboxkit.relay")
        self.stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._linger_waits = linger_waits(options.linger, longest=options.linger_step)
        self._linger_step = len(self._linger_waits)
        self._gate_retry = options.gate_retry
        self._slots = asyncio.Semaphore(options.max_in_flight)
        self._limit = options.batch_size  # the last claim's limit
        # Items arriving per second, smoothed over claims (the gather window's estimate),
        # and when the last claim was sent.
        self._arrivals = 0.0
        self._last_claim: float | None = None
        self._in_flight: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        # Its parts (queue/loop_wiring.py): faults, hand-back, settle, carry, split mode's
        # local queue (None but in split mode) and the lease extension.
        parts: LoopParts[T, R] = wire_loop(
            store, sink, observer, options, log=self.log, wake=self._wake.set,
            stopping=self.stopping, slots=self._slots, sleep=self._sleep, fail=self._fail,
            retry_for=retry_for, on_lease_lost=on_lease_lost,
        )  # fmt: skip
        self._errors, self._denied = parts.errors, parts.denied
        self._hand_back, self._settling = parts.hand_back, parts.settling
        self._carry, self._extend, self._local = parts.carry, parts.extend, parts.local

    @property
    def first_settled(self) -> Callable[[int, float], None] | None:
        """Told once, of the first claim settled done: how many items, how long after it."""
        return self._settling.first_settled

    @first_settled.setter
    def first_settled(self, tell: Callable[[int, float], None] | None) -> None:
        self._settling.first_settled = tell

    # -- lifecycle ----------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; in-flight work finishes (or is released at ``shutdown_timeout``)."""
        self.stopping.set()
        self._wake.set()
        if self._local is not None:
            self._local.room.set()

    def wake(self) -> None:
        """Claim now (a wake-up, or an item's key freed)."""
        self._wake.set()

    def status(self) -> LoopStatus:
        local = self._local
        in_flight = len(self._in_flight) if local is None else local.held
        return LoopStatus(self._denied.reason, in_flight, self.stopping.is_set())

    def deny(self, exc: StoreDenied, what: str) -> None:
        """The store refused ``what``: stop claiming and say so once, in one line."""
        self._denied.deny(exc, what)

    async def run(self) -> None:
        """Claim until :meth:`stop`; the first failure of a side task or a batch stops it."""
        self._failure = None
        side = [asyncio.create_task(factory(), name=name) for name, factory in self.side_tasks]
        if self.options.listen and self.store.can_listen:
            listen = self.store.listen(self._wake.set)
            side.append(asyncio.create_task(listen, name=f"{self.options.name}:listen"))
        monitor = asyncio.create_task(
            watch_side_tasks(side, self._fail), name=f"{self.options.name}:monitor"
        )
        if self._local is not None:
            self._local.start()
        try:
            await self._claim_loop()
        finally:
            if self._carry is not None:
                self._carry.flush()  # no claim follows: a parked settle runs on its own
            monitor.cancel()
            await self._drain_in_flight()
            for task, exc in await cancel_and_capture_errors([monitor, *side]):
                self._fail(task.get_name(), exc)  # (ignored if it stopped the loop already)
        if self._failure is not None:
            raise self._failure

    def _fail(self, what: str, exc: BaseException) -> None:
        """Stop the loop because ``what`` failed; :meth:`run` raises ``exc`` once drained."""
        if self._failure is None:
            self._failure = exc
            self.log.error(
                "%s failed, stopping the %s: %s",
                what,
                self.options.words.who,
                redact(f"{type(exc).__name__}: {exc}"),
                exc_info=exc,
            )
        self.stop()

    def _on_batch_done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        if self.ordering is not None:
            self._wake.set()  # the batch's keys are free again: claim now, not at the poll
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._fail("batch", exc)

    async def _drain_in_flight(self) -> None:
        if self._local is not None:
            await self._local.drain(self.options.shutdown_timeout)
            return
        if not self._in_flight:
            return
        pending = set(self._in_flight)
        _done, still = await asyncio.wait(pending, timeout=self.options.shutdown_timeout)
        for task in still:
            task.cancel()
        if still:
            await asyncio.gather(*still, return_exceptions=True)

    # -- the loop -----------------------------------------------------------------

    async def _claim_loop(self) -> None:
        store = self.store
        while await self._acquire_slot():
            if self._denied.cause is not None:
                self._release_slot()
                if self._carry is not None:
                    self._carry.flush()
                await self._denied.wait_until_allowed(self.stopping.is_set)
                continue
            # Clear before claiming: a commit notified during the claim wakes the next one.
            self._wake.clear()
            try:
                claim = await self._claim()
            except StoreDenied as exc:
                self._release_slot()
                self.observer.database_error("claim", exc.cause, False)
                self.deny(exc, "claims")
                continue
            except StoreError as exc:
                # A lost connection or a failed statement (a timeout, a trigger): back off, retry.
                self._release_slot()
                await self._errors.failed("claim", exc)
                continue
            except BaseException:
                self._release_slot()
                raise
            if claim is None:
                self._release_slot()
                await self._wait_for_work()
                continue
            if self._local is not None:
                self._local.add(claim)  # the runners take its items in turn
            else:
                self._start(claim)
            # Work found: look again soon, and writers need not wake us meanwhile.
            self._linger_step = 0
            if self._carry is not None:
                self._carry.open()  # a claim comes next: it may carry this claim's settle
            self._gate_retry = self.options.gate_retry
            if store.gate_closed:
                await self._open_gate()
            if len(claim.ids) < self._limit:
                # Caught up: look again after a few ms, then wait for a wake-up or the poll
                # interval. A full batch loops straight back and claims N+1 while N is
                # being processed.
                await self._wait_for_work()

    def _start(self, claim: Claim[T]) -> None:
        task = asyncio.create_task(self._process(claim))
        if self.ordering is not None:
            self.ordering.track(task)
        self._in_flight.add(task)
        task.add_done_callback(self._on_batch_done)

    def _release_slot(self) -> None:
        if self._local is None:  # (split mode: room is counted by the local queue)
            self._slots.release()

    async def _acquire_slot(self) -> bool:
        """Wait for an in-flight slot; False once stopping (even while slots are busy)."""
        if self.stopping.is_set():
            return False
        if self._local is not None:
            return await self._room()
        if not self._slots.locked():
            # A free slot is taken without yielding to the event loop, so the next claim
            # is sent to the database before the batch just claimed starts producing:
            # the claim's database time then overlaps the sink's CPU time.
            await self._slots.acquire()
            return True
        acquire = asyncio.ensure_future(self._slots.acquire())
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({acquire, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not acquire.done():
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
        if acquire.done() and not acquire.cancelled():
            if not self.stopping.is_set():
                return True
            self._slots.release()
        return False

    async def _room(self) -> bool:
        """Split mode: wait until a claim has room (fewer items held than the slots and the
        prefetch, and the local queue down to a round of the runners); False once stopping."""
        local = self._local
        assert local is not None
        slots = self.options.max_in_flight
        while not self.stopping.is_set():
            if local.held < slots + self._prefetch() and local.queued <= slots:
                return True
            local.room.clear()
            await local.room.wait()
        return False

    async def _claim(self) -> Claim[T] | None:
        options = self.options
        token = uuid.uuid4()
        limit = options.batch_size
        if self._local is not None:  # one item per free slot, and the prefetch
            held = self._local.held
            limit = max(1, min(limit, options.max_in_flight + self._prefetch() - held))
        self._limit = limit
        policy: ClaimPolicy = None
        if self.ordering is not None:
            policy = self.ordering.before_claim(token, limit)
        started = time.perf_counter()
        since = None if self._last_claim is None else started - self._last_claim
        self._last_claim = started

        def plain() -> Coroutine[Any, Any, Claim[T] | None]:
            return self.store.claim(
                limit=limit,
                lease=options.lease,
                token=token,
                owner=options.owner,
                max_attempts=options.retry.max_attempts,  # the crash-loop guard
                policy=policy,
            )

        carry = self._carry
        if carry is None:
            claim = await plain()
        else:  # (it carries a settle parked during the wait, if one was)
            claim = await carry.claim(plain, limit=limit, lease=options.lease, token=token,
                                      owner=options.owner,
                                      max_attempts=options.retry.max_attempts)  # fmt: skip
        self._errors.succeeded()
        count = 0 if claim is None else len(claim.ids)
        self.observer.claimed(count, time.perf_counter() - started)
        if since is not None and since > 0:
            sample = count / since
            self._arrivals += RATE_WEIGHT * (sample - self._arrivals)
        if claim is not None and claim.dead:
            # The crash-loop guard or the size guard dead-lettered these in the claim
            # itself: counted and logged like every other dead letter.
            sink = self.sink
            dead = [(item, sink.dead_outcome(error, kind)) for item, kind, error in claim.dead]
            self.observer.settled((), (), dead)
            if not claim.ids:
                return None
        return claim

    def _prefetch(self) -> int:
        """How many items a split claim may take beyond the free slots now: none until items
        have run, then as many as wait less than a quarter of the lease for a slot."""
        cap = self.options.prefetch
        run_time = None if self._local is None else self._local.run_time
        if not cap or run_time is None:
            return 0
        budget = self.options.lease / 4 * self.options.max_in_flight / max(run_time, 1e-6)
        return max(0, min(cap, int(budget)))

    async def _wait_for_work(self) -> None:
        if self._wake.is_set() or self.stopping.is_set():
            return
        if self._hand_back.target_restored():  # the outage is over: what it handed back is due
            await self._hand_back.target_back()
            return
        step = self._linger_step
        if step < len(self._linger_waits):  # lingering after work: look again shortly
            self._linger_step = step + 1
            if self._carry is not None:
                self._carry.open()  # a claim ends this wait: it may carry a settle
            await self._wait(self._gathering() if step == 0 else self._linger_waits[step])
            return
        if self.options.listen and self.store.can_listen and not self.store.gate_closed:
            if await self._close_gate():
                return  # claim once more: what writers committed without a wake-up is visible
            # A writer is between its INSERT and its COMMIT (or another claimer waits):
            # look again soon, less often the longer it lasts.
            retry = self._gate_retry
            self._gate_retry = min(retry * 2, GATE_RETRY[1])
            await self._wait(retry)
            return
        if self._carry is not None:
            self._carry.flush()  # no claim soon: a parked settle runs on its own
        await self._wait(self.options.poll_interval)

    def _gathering(self) -> float:
        """The first look after work: the linger's first wait, or, while items arrive at
        least two a gather window, long enough for about 32 of them (at most the window)."""
        window, rate = self.options.gather, self._arrivals
        first = self._linger_waits[0]
        if window <= 0 or rate * window < GATHER_MIN_ITEMS:
            return first
        return max(first, min(window, GATHER_ITEMS / rate))

    async def _wait(self, seconds: float) -> None:
        # asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own,
        # 4 % of the event loop's time when the loop looks again every few ms.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)

    async def _close_gate(self) -> bool:
        try:
            return await self.store.close_gate()
        except StoreError as exc:  # the next claim meets and handles it
            self.log.debug("could not take the wake-up lock: %s", first_line(exc.cause))
            return False

    async def _open_gate(self) -> None:
        try:
            await self.store.open_gate()
        except StoreError as exc:
            self.log.debug("could not release the wake-up lock: %s", first_line(exc.cause))

    # -- one claim ----------------------------------------------------------------

    async def _process(self, claim: Claim[T]) -> None:
        try:
            items = claim.items
            with self.observer.processing(items):
                started = time.perf_counter()
                outcomes = await self._run_sink(claim)
                seconds = time.perf_counter() - started
                self.observer.processed(items, outcomes, seconds)
            await self._settling.settle(claim, outcomes)
        except StoreError as exc:
            self._settling.failed(exc)
        except asyncio.CancelledError:
            # Forced shutdown mid-work: hand the items back now rather than at lease expiry.
            await asyncio.shield(self._settling.release(claim))
            raise
        finally:
            self._slots.release()

    async def _run_sink(self, claim: Claim[T]) -> Sequence[R]:
        # Work still running after lease/3 extends its items' lease every lease/3: only the
        # sink's own timeout bounds it, never the lease.
        lease = self.options.lease
        heartbeat = LeaseHeartbeat(
            lambda: self._extend_leases(claim), lease / 3, name=self.options.name
        )
        heartbeat.start()
        try:
            return await self.sink.process(claim.token, claim.items)
        finally:
            await heartbeat.stop()

    async def _extend_leases(self, claim: Claim[T]) -> None:
        """One heartbeat: push the claim's leases to now + lease, fenced by its token; tell
        ``on_lease_lost`` when they are no longer all held."""
        held = await self._extend(claim)
        if held is not None and held < len(claim.ids) and self.on_lease_lost is not None:
            self.on_lease_lost(claim, held)
