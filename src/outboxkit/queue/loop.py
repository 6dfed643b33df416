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
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from outboxkit._redact import redact
from outboxkit._text import first_line
from outboxkit.queue.carry import SettleCarry
from outboxkit.queue.decide import Outcome, RetryPolicy
from outboxkit.queue.faults import DatabaseErrors, DeniedWrites
from outboxkit.queue.handback import HandBack
from outboxkit.queue.heartbeat import LeaseHeartbeat
from outboxkit.queue.local_queue import LocalQueue
from outboxkit.queue.settling import SettleObserver, Settling
from outboxkit.queue.store import (
    Attempted,
    Claim,
    ClaimPolicy,
    ClaimsSettling,
    QueueStore,
    StoreDenied,
    StoreError,
    StoreUnavailable,
)

T = TypeVar("T", bound=Attempted)
#: The outcome a sink reports per item (PublishResult for the relay).
R = TypeVar("R", bound=Outcome)
T_contra = TypeVar("T_contra", bound=Attempted, contravariant=True)
O_co = TypeVar("O_co", bound=Outcome, covariant=True)
O_contra = TypeVar("O_contra", bound=Outcome, contravariant=True)

# While a writer holds the wake-up gate open (between its INSERT and its COMMIT), a loop
# with nothing to do looks again after this long, doubling up to the second figure.
_GATE_RETRY = (0.005, 0.1)
# A loop that found work looks again after this long (then twice as long, ...): at a
# steady 1 000 events/s, 1 ms gave 1.9 events per claim and 2 ms 3.0, for a third less
# relay CPU per event at +0.5 ms p50 (bench/concurrent_writers.py --latency-only).
_FIRST_LOOK = 0.002
# The gather window's goal: a look after work waits until about this many items are due
# (never longer than the window); items arriving slower than 2 a window get no wait at all.
_GATHER_ITEMS = 32
_GATHER_MIN_ITEMS = 2.0
# How much each claim moves the arrival-rate estimate (an exponential moving average).
_RATE_WEIGHT = 0.3


def linger_waits(
    linger: float, first: float = _FIRST_LOOK, longest: float | None = None
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


class Sink(Protocol[T_contra, O_co]):
    """What processes a claim's items: a publisher (the relay) or a handler runner (tasks).

    ``process`` returns one outcome per item, in order, and does not raise for an item's
    failure (an exception fails the loop). ``target_down`` says the sink's own client
    reports its target unreachable (a retryable failure then is the outage's, not the
    item's); ``restored_since(t)`` that it reported the target back after ``t`` (monotonic).
    """

    @property
    def name(self) -> str: ...

    async def process(self, token: uuid.UUID, items: Sequence[T_contra]) -> Sequence[O_co]: ...

    def target_down(self) -> bool: ...

    def restored_since(self, when: float) -> bool: ...

    def dead_outcome(self, error: str, error_class: str) -> O_co:
        """The outcome observers get for an item the store dead-lettered at claim."""
        ...


class QueueObserver(SettleObserver[T_contra, O_contra], Protocol[T_contra, O_contra]):
    """The hooks the loop calls (``outboxkit.sink.observer.RelayObserver`` is one, the task
    worker's another): the settle's (queue/settling.py) and these. ``processing`` wraps the
    sink's work on a claim (the relay's publish, the worker's handlers); ``processed``
    follows it, before the settle."""

    def claimed(self, count: int, seconds: float) -> None: ...

    def processing(self, items: Sequence[T_contra]) -> AbstractContextManager[None]: ...

    def processed(
        self, items: Sequence[T_contra], outcomes: Sequence[O_contra], seconds: float
    ) -> None: ...


class Ordering(Protocol):
    """A claim policy with state (ordered mode): asked before each claim, told of each batch.

    ``track`` gets the task processing each claim it chose; the loop claims again when one
    ends (its keys are free again).
    """

    def before_claim(self, token: uuid.UUID, limit: int) -> ClaimPolicy: ...

    def track(self, task: asyncio.Task[None]) -> None: ...


@dataclass(frozen=True, slots=True)
class Wording:
    """The words of the loop's log lines: a relay publishes rows, a worker runs tasks."""

    who: str  # "relay"
    items: str  # "row(s)"
    working: str  # "publishing"
    lost: str  # what a lost lease means for the items
    again: str  # "published again"


RELAY_WORDS = Wording(
    who="relay",
    items="row(s)",
    working="publishing",
    lost="were re-claimed by another relay before this one settled them",
    again="they are published at least once",
)
WORKER_WORDS = Wording(
    who="worker",
    items="task(s)",
    working="running",
    lost="were cancelled, or re-claimed by another worker, before this one settled them",
    again="a cancelled task stays cancelled, a re-claimed one runs again",
)


def default_owner_id() -> str:
    """host-pid-random: a claimer's id (a relay's, a worker's) unique per process, readable
    in ``claimed_by``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class LoopOptions:
    """The claim loop's options (validated by whoever builds it: the relay, the worker)."""

    owner: str
    batch_size: int
    max_in_flight: int
    lease: float
    poll_interval: float
    linger: float
    listen: bool
    shutdown_timeout: float
    retry: RetryPolicy
    #: Task names and log lines start with it.
    name: str = "outboxkit-relay"
    #: Hand each claimed item to the sink on its own, with a slot of its own (task mode: a
    #: slow item never holds a fast one's settle). A claim then takes up to as many items as
    #: slots are free (at most ``batch_size``): one statement claims several. The items run
    #: on ``max_in_flight`` runners and settle in groups as they finish (queue/local_queue.py).
    split: bool = False
    #: Split mode: a claim may take up to this many items beyond the free slots; they wait
    #: in a local queue (as graphile-worker's ``localQueue``) for a runner, so one statement
    #: claims a batch even while every slot is busy. Bounded by the lease: the last one
    #: waits about prefetch x run time / slots, kept under a quarter of it.
    prefetch: int = 0
    #: The first wait when the wake-up gate cannot be closed because a writer holds it open
    #: (between its INSERT and its COMMIT, usually a round trip): doubled up to 100 ms.
    gate_retry: float = _GATE_RETRY[0]
    #: The longest of the linger's waits (None: they double until the linger is spent). A
    #: commit during a wait is seen at its end: the task worker keeps them short.
    linger_step: float | None = None
    #: The gather window (0: off): after a claim that found work but fewer items than it
    #: asked for, while items arrive at least two a window, the next look waits until
    #: about 32 items are due, at most this long, instead of the linger's first 2 ms. At
    #: steady rates a claim then takes several items for one claim and one settle
    #: statement (a claim costs the database about the same for 2 items as for 100). The
    #: first item after a quiet spell is never held: only the looks after work wait. The
    #: relay sets it; the task worker keeps it off (its latency budget is a few ms).
    gather: float = 0.0
    #: How the log lines name the process, its items and their work (the worker's own).
    words: Wording = RELAY_WORDS


@dataclass(frozen=True, slots=True)
class LoopStatus:
    """What readiness and metrics read of a running loop (no I/O)."""

    #: Why the store refuses the loop's writes (claiming stopped), or None.
    denied: str | None
    in_flight: int
    stopping: bool


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
        # A store that fails (queue/faults.py): retried with backoff, an outage one episode.
        self._errors = DatabaseErrors(observer, self.log, self._sleep)
        # Configuration faults: the store refused a claim or a settle (no privilege,
        # read-only). The loop claims nothing while one lasts.
        self._denied = DeniedWrites(store, self._errors, self.log, options.words.who, self._sleep)
        # Items handed back untried while the sink's target is down (queue/handback.py).
        self._hand_back = HandBack(store, sink, options.retry, self.log, self._wake.set)
        # The settle path (queue/settling.py): decide, write, report, release at shutdown.
        self._settling: Settling[T, R] = Settling(
            store,
            sink,
            observer,
            options,
            errors=self._errors,
            denied=self._denied,
            hand_back=self._hand_back,
            stopping=self.stopping,
            sleep=self._sleep,
            log=self.log,
            retry_for=retry_for,
        )
        # A claim after a wait settles the claim before it in the same statement, where the
        # store can (queue/carry.py): one statement a cycle at steady rates, not two.
        self._carry: SettleCarry[T] | None = None
        if isinstance(store, ClaimsSettling) and store.carries_settles and not options.split:
            self._carry = SettleCarry(store, lambda: not self._slots.locked())
            self._settling.carry = self._carry.offer
        self._failure: BaseException | None = None
        #: Split mode: the items between their claim and their settle, and the runners.
        self._local: LocalQueue[T, R] | None = None
        if options.split:
            lost = on_lease_lost
            self._local = LocalQueue(
                sink,
                observer,
                self._settling,
                slots=options.max_in_flight,
                lease=options.lease,
                name=options.name,
                extend=self._extend,
                lease_lost=None if lost is None else (lambda claim: lost(claim, 0)),
                fail=self._fail,
                log=self.log,
                track_run_time=options.prefetch > 0,
            )

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
            self._monitor_side_tasks(side), name=f"{self.options.name}:monitor"
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
            for task, exc in await _cancel_and_capture_errors([monitor, *side]):
                self._fail(task.get_name(), exc)  # (ignored if it stopped the loop already)
        if self._failure is not None:
            raise self._failure

    async def _monitor_side_tasks(self, side_tasks: list[asyncio.Task[None]]) -> None:
        """Wait for a side task to end; one that failed stops the loop with its error."""
        pending = set(side_tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and (exc := task.exception()) is not None:
                    self._fail(task.get_name(), exc)
                    return

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
            self._arrivals += _RATE_WEIGHT * (sample - self._arrivals)
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
            self._gate_retry = min(retry * 2, _GATE_RETRY[1])
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
        if window <= 0 or rate * window < _GATHER_MIN_ITEMS:
            return first
        return max(first, min(window, _GATHER_ITEMS / rate))

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

    async def _extend(self, claim: Claim[T]) -> int | None:
        """Push the claim's leases to now + lease, fenced by its token: how many it held.

        A failure is logged (None) and the work goes on: the settle copes with a lost lease.
        """
        try:
            held = await self.store.extend_leases(claim, self.options.lease)
        except StoreError as exc:
            self.observer.database_error("extend", exc.cause, isinstance(exc, StoreUnavailable))
            self.log.warning(
                "could not extend the lease of %d %s still %s (%s)",
                len(claim.ids),
                self.options.words.items,
                self.options.words.working,
                first_line(exc.cause),
            )
            return None
        self.log.debug(
            "%s for %.1fs: extended the lease of %d of %d by %.1fs",
            self.options.words.working,
            time.monotonic() - claim.claimed_at,
            held,
            len(claim.ids),
            self.options.lease,
        )
        return held


async def _cancel_and_capture_errors(
    tasks: list[asyncio.Task[None]],
) -> list[tuple[asyncio.Task[None], Exception]]:
    """Cancel ``tasks``, wait for them all, and return the errors they ended with."""
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return [
        (task, result)
        for task, result in zip(tasks, results, strict=True)
        if isinstance(result, Exception)
    ]
