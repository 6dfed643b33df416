"""The worker: the queue core's claim loop with the handler sink and the task table's store.

As the relay is the loop with a publisher sink (relay/engine.py), ``Worker`` is the loop
(outboxkit.queue.loop) with :class:`~outboxkit.tasks.sink.HandlerSink` and a backend's task
store (the port of queue/tasks.py) behind the core's claim policies (queue/task_claims.py:
the queues in turn, per-queue limits, suspects run alone): a claim per free slot and the
prefetch, ``concurrency`` runners, a lease heartbeat per claim, settles grouped as tasks finish,
retries from ``decide()`` with each handler's schedule, a drain on stop (running handlers get
``shutdown_timeout``, the rest are handed back). No SQL here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from outboxkit._backoff import Backoff
from outboxkit._redact import redact, remember_secrets
from outboxkit._text import first_line
from outboxkit.backends import backend_for
from outboxkit.backends.ports import PoolerMode
from outboxkit.queue.decide import Outcome, RetryPolicy
from outboxkit.queue.loop import WORKER_WORDS, ClaimLoop, LoopOptions, default_owner_id
from outboxkit.queue.store import Claim, StoreError
from outboxkit.queue.task_claims import TaskClaims
from outboxkit.queue.tasks import ClaimedTask, Retention
from outboxkit.tasks.lifecycle import LifecycleEvents
from outboxkit.tasks.periodic import TICK, run_periodic
from outboxkit.tasks.registry import Tasks
from outboxkit.tasks.sink import HandlerSink
from outboxkit.write.outbox import Outbox

log = logging.getLogger("outboxkit.worker")
_NOTHING = contextlib.nullcontext()
#: A due task whose name this worker has no handler for is left to the workers that have
#: one; after this many seconds unclaimed by any, the workers that lack it fail it.
UNHANDLED_GRACE = 3600.0
#: Tasks a claim may take beyond the free slots by default: this many per slot, at most
#: DEFAULT_PREFETCH_CAP (and never more than wait under a quarter of the lease: queue/loop.py).
PREFETCH_PER_SLOT = 20
DEFAULT_PREFETCH_CAP = 500
#: Tasks one sweep of unhandled names fails at most (a full batch: the next sweep at once).
UNHANDLED_BATCH = 1000
#: Finished tasks kept for their results are purged past their time this often (seconds),
#: this many per statement (a full batch: the next one at once).
RESULTS_PURGE_EVERY = 60.0
#: Waiting tasks (``after=``) whose upstream tasks finished are looked for this often
#: (seconds); a settle releases its own tasks' dependents at once.
RELEASE_SWEEP_EVERY = 1.0
RESULTS_PURGE_BATCH = 1000


@dataclass(slots=True)
class WorkerStats:
    """Counts since start (what the summary line and tests read)."""

    done: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    lost_leases: int = 0


class TaskObserver(Protocol):
    """What a worker tells an outside observer (``ops/task_metrics.py``'s TaskMetrics)."""

    def ran(self, tasks: Sequence[ClaimedTask], seconds: float) -> None: ...

    def settled(
        self,
        done: Sequence[ClaimedTask],
        retried: Sequence[ClaimedTask],
        failed: Sequence[ClaimedTask],
    ) -> None: ...


class _Observer:
    """The loop's hooks, for tasks: counts, one log line per failed task, the outside observer."""

    def __init__(self, stats: WorkerStats, outside: TaskObserver | None = None) -> None:
        self.stats = stats
        self.outside = outside
        #: Why the last claim failed, until one succeeds (``/readyz``).
        self.database_problem: str | None = None

    def claimed(self, count: int, seconds: float) -> None:
        self.database_problem = None

    def processing(self, messages: Sequence[ClaimedTask]) -> AbstractContextManager[None]:
        return _NOTHING  # (a generator-based context manager per task cost ~2 us)

    def processed(
        self, messages: Sequence[ClaimedTask], results: Sequence[Outcome], seconds: float
    ) -> None:
        if self.outside is not None:
            self.outside.ran(messages, seconds)

    def settled(
        self,
        published: Sequence[ClaimedTask],
        retried: Sequence[tuple[ClaimedTask, Outcome]],
        dead: Sequence[tuple[ClaimedTask, Outcome]],
    ) -> None:
        self.stats.done += len(published)
        self.stats.retried += len(retried)
        self.stats.failed += len(dead)
        if self.outside is not None:
            self.outside.settled(published, [t for t, _ in retried], [t for t, _ in dead])
        for task, outcome in retried:
            log.info(
                "task %d (%s) attempt %d failed, retrying: %s",
                task.id, task.task_name, task.attempt, redact(outcome.error or ""),
            )  # fmt: skip
        for task, outcome in dead:
            log.error(
                "task %d (%s) failed for good after attempt %d: %s",
                task.id, task.task_name, task.attempt, redact(outcome.error or ""),
            )  # fmt: skip

    def handed_back(self, count: int, error: str | None) -> None:
        self.stats.released += count

    def lost_leases(self, count: int) -> None:
        self.stats.lost_leases += count

    def database_error(self, operation: str, error: Exception, connection_lost: bool) -> None:
        if operation == "claim" or connection_lost:
            self.database_problem = redact(
                f"the database {'is unreachable' if connection_lost else 'refused a ' + operation}"
                f": {first_line(error, with_type=True)}"
            )


class Worker:
    """Runs the handlers of ``tasks`` from its table until :meth:`stop`.

    ``concurrency``: tasks running at once (sync handlers get as many threads).
    ``batch_size``: 1 (default): a claim takes a task per free slot plus ``prefetch``, each
    runs on its own and settles with those finishing meanwhile (queue/local_queue.py); more:
    a claim's tasks run at once and settle together, ``concurrency // batch_size`` claims
    in flight (no faster for short tasks any more; a slow one holds its batch's settle).
    ``lease``: seconds a claim holds a task; the heartbeat extends it every lease/3 while
    the handler runs, so only a dead or frozen worker loses it. ``shutdown_timeout``: how
    long a stop waits for running handlers before handing their tasks back.
    ``queue_limits``: at most N tasks of a queue at once (``--queue name=N``); the
    worker's other queues use the rest of ``concurrency``.
    ``pooler`` / ``direct_dsn``: behind a transaction pooler (README "Behind PgBouncer"),
    LISTEN and the wake-up gate's lock on ``direct_dsn`` (PostgreSQL itself) or polling only.
    """

    def __init__(
        self,
        tasks: Tasks,
        dsn: str,
        *,
        queues: Sequence[str] = ("default",),
        concurrency: int = 10,
        lease: float = 30.0,
        poll_interval: float = 1.0,
        shutdown_timeout: float = 30.0,
        retention: Retention = "delete",
        outbox: Outbox | None = None,
        listen: bool = True,
        worker_id: str | None = None,
        periodic_tick: float = TICK,
        batch_size: int = 1,
        observer: TaskObserver | None = None,
        linger: float = 0.03,
        pooler: PoolerMode | None = None,
        direct_dsn: str | None = None,
        queue_limits: Mapping[str, int] | None = None,
        unhandled_grace: float = UNHANDLED_GRACE,
        prefetch: int | None = None,
    ) -> None:
        # The database's backend, chosen once: its task store, or its one-line refusal.
        backend = backend_for(dsn)
        backend.refuse("tasks")
        # A handler's error may quote the database's password (a connection string it
        # built): masked in the log, the stored error and the traceback, as the relay does.
        remember_secrets(dsn)
        if direct_dsn:
            remember_secrets(direct_dsn)
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if prefetch is None:
            prefetch = min(DEFAULT_PREFETCH_CAP, PREFETCH_PER_SLOT * concurrency)
        if prefetch < 0:
            raise ValueError("prefetch cannot be negative")
        if not 1 <= batch_size <= concurrency:
            raise ValueError("batch_size must be between 1 and concurrency")
        for queue, limit in (queue_limits or {}).items():
            if queue not in queues or limit < 1:
                raise ValueError(
                    f"queue limit {queue}={limit}: the queue must be one of the worker's"
                    f" queues {list(queues)} and its limit at least 1"
                )
        if not lease > 0 or not poll_interval > 0 or shutdown_timeout < 0:
            raise ValueError("lease and poll_interval must be > 0, shutdown_timeout >= 0")
        self.tasks = tasks
        self.worker_id = worker_id or default_owner_id()
        self.stats = WorkerStats()
        lifecycle = LifecycleEvents(tasks, outbox if outbox is not None else Outbox(), backend)
        per_key = {
            t.name: t.concurrency_per_key for t in tasks.types.values() if t.concurrency_per_key > 1
        }
        key_rates = {
            t.name: t.rate_per_key for t in tasks.types.values() if t.rate_per_key is not None
        }
        fair = sorted(t.name for t in tasks.types.values() if t.fair)
        if per_key or key_rates or fair:
            backend.refuse("task_key_limits")  # (a backend whose claim cannot keep them)
        self.store = backend.task_store(
            dsn,
            tasks.table,
            queues=list(queues),
            retention=retention,
            on_settle=lifecycle if lifecycle.wanted() else None,
            pooler=pooler,
            direct_dsn=direct_dsn,
            names=list(tasks.types),
            per_key=per_key,
            fair=fair,
        )
        #: The claim policies (queues in turn, limits, suspects alone) over the store.
        self.claims = TaskClaims(
            self.store,
            queues=queues,
            queue_limits=queue_limits,
            concurrency={
                t.name: t.concurrency for t in tasks.types.values() if t.concurrency is not None
            },
            rates={t.name: t.rate for t in tasks.types.values() if t.rate is not None},
            per_key=per_key,
            key_rates=key_rates,
            fair=fair,
        )
        self.sink = HandlerSink(
            tasks, store=self.store, threads=concurrency, outbox=outbox, worker_id=self.worker_id
        )
        options = LoopOptions(
            owner=self.worker_id,
            # By default a claim takes up to one task per free slot and each task runs and
            # settles on its own (split): a slow task never holds a fast one's settle. With
            # batch_size > 1 a claim's tasks run at once and settle together (short tasks:
            # fewer statements per task, a slow one delays its batch-mates' settle).
            batch_size=concurrency + prefetch if batch_size == 1 else batch_size,
            max_in_flight=concurrency if batch_size == 1 else max(1, concurrency // batch_size),
            split=batch_size == 1,
            prefetch=prefetch if batch_size == 1 else 0,
            lease=lease,
            poll_interval=poll_interval,
            linger=linger,
            listen=listen,
            shutdown_timeout=shutdown_timeout,
            retry=RetryPolicy(max_attempts=tasks.max_attempts),
            name="outboxkit-worker",
            # A task is wanted within milliseconds of its commit (bench/tasks_latency.py):
            # while lingering look again every 2 ms at most (the relay's waits double to
            # 16 ms, a commit early in one waits it out), and a writer holding the gate open
            # commits within about a round trip: look again after 1 ms, not 5.
            linger_step=0.002,
            gate_retry=0.001,
            words=WORKER_WORDS,
        )
        side: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = [
            ("outboxkit-worker:unhandled", lambda: self._fail_unhandled(unhandled_grace)),
            ("outboxkit-worker:results", self._purge_results),
            ("outboxkit-worker:dependents", self._release_dependents),
        ]
        if tasks.schedules:  # periodic tasks: every worker inserts due slots, one wins each
            schedules = backend.schedules(dsn, tasks.table, pooler=pooler)
            side.append(
                (
                    "outboxkit-worker:periodic",
                    lambda: run_periodic(
                        schedules,
                        list(tasks.schedules.values()),
                        tasks.periodic_payloads,
                        self._loop.stopping,
                        self._loop.wake,
                        tick=periodic_tick,
                    ),
                )
            )
        self._observer = _Observer(self.stats, observer)
        self._loop: ClaimLoop[ClaimedTask, Outcome] = ClaimLoop(
            self.claims,
            self.sink,
            self._observer,
            options,
            logger=log,
            retry_for=self._policy,
            side_tasks=side,
            on_lease_lost=self._lease_lost,
        )
        self.claims.on_free = self._loop.wake  # room again after a claim passed

    def __repr__(self) -> str:
        return f"Worker(table={self.tasks.table!r}, worker_id={self.worker_id!r})"

    def _policy(self, task: ClaimedTask) -> RetryPolicy:
        """The task's retries: its handler's schedule, its own max_attempts first, plus the
        attempts it was spared (its worker died while it ran beside others)."""
        task_type = self.tasks.types.get(task.task_name)
        if task_type is None:
            cap = task.max_attempts or self.tasks.max_attempts
            return RetryPolicy(max_attempts=cap + task.spared)
        return RetryPolicy(
            max_attempts=(task.max_attempts or task_type.max_attempts) + task.spared,
            base=task_type.retry_base,
            cap=task_type.retry_cap,
            delays=task_type.retry_delays,
        )

    def _lease_lost(self, claim: Claim[ClaimedTask], held: int) -> None:
        if held == 0:  # (part of a batch: which ones is not known; their settle is fenced)
            self.sink.lost(claim.ids)

    async def _fail_unhandled(self, grace: float) -> None:
        """Now and then, fail the due tasks no worker has claimed for ``grace`` seconds among
        the names this one has no handler for (a rolling deploy's new names are left to the
        workers that have them until then); one line per sweep that failed any."""
        backoff = Backoff(base=1.0, cap=60.0)
        stopping = self._loop.stopping
        every = min(60.0, max(grace / 10, 0.2))
        delay = every  # not at start: a short-lived worker (run_pending) never sweeps, and
        # no sweep's connection is cut by a stop that follows the start at once
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay)
            if stopping.is_set():
                return
            try:
                failed = await self.store.fail_unhandled(grace, UNHANDLED_BATCH)
            except StoreError as exc:
                log.debug("the sweep of unhandled task names failed: %s", exc)
                delay = backoff.next_delay()
            else:
                backoff.reset()
                delay = 0.0 if len(failed) >= UNHANDLED_BATCH else every  # more at once
                if failed:
                    names = sorted(set(failed))
                    log.warning(
                        "failed %d task(s) that no worker claimed within %.0f s of their due"
                        " time; no handler here for %s%s: deploy a worker that has one, then"
                        " `outboxkit tasks replay --all --name NAME`",
                        len(failed), grace, ", ".join(names[:5]),
                        f" and {len(names) - 5} more" if len(names) > 5 else "",
                    )  # fmt: skip

    async def _purge_results(self) -> None:
        """Now and then, delete the finished tasks kept for their results past their time
        (``keep_result``), a batch per statement (whichever worker runs first does it)."""
        await self._sweep(
            RESULTS_PURGE_EVERY, lambda: self.store.purge_kept(RESULTS_PURGE_BATCH),
            "the purge of kept results",
        )  # fmt: skip

    async def _release_dependents(self) -> None:
        """Every second, decide waiting tasks whose upstream tasks finished without their
        settle releasing them (an enqueue that raced the completion, a worker that died
        between the two statements, a failed or cancelled upstream task)."""
        await self._sweep(
            RELEASE_SWEEP_EVERY, lambda: self.store.release_dependents(None, RESULTS_PURGE_BATCH),
            "the release of waiting tasks", wake=True,
        )  # fmt: skip

    async def _sweep(
        self,
        every: float,
        step: Callable[[], Coroutine[Any, Any, int]],
        what: str,
        *,
        wake: bool = False,
    ) -> None:
        """Run ``step`` (one batch, how many rows it changed) every ``every`` seconds until
        the worker stops, at once again after a full batch; a failure is logged at debug
        (the next sweep retries) and never stops the worker. ``wake``: claim at once after
        a sweep that changed rows (tasks became claimable)."""
        stopping = self._loop.stopping
        delay = every
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay)
            if stopping.is_set():
                return
            try:
                changed = await step()
            except StoreError as exc:
                log.debug("%s failed: %s", what, exc)
                delay = every
            else:
                if wake and changed:
                    self._loop.wake()
                delay = 0.0 if changed >= RESULTS_PURGE_BATCH else every

    def not_ready_reason(self) -> str | None:
        """Why this worker cannot do its work now (``/readyz``), or None."""
        return self._observer.database_problem or self.sink.degraded_reason()

    def threads_running(self) -> int:
        """Sync handlers still running in a thread (past their timeout or the grace)."""
        return self.sink.threads_running()

    def stop(self) -> None:
        """Stop taking tasks; running handlers get ``shutdown_timeout``, then are handed back."""
        self._loop.stop()

    async def run(self) -> None:
        """Work until :meth:`stop`. Raises only for errors a restart won't fix."""
        log.info(
            "worker %s starting: table=%s queues=%s handlers=%s",
            self.worker_id,
            self.tasks.table,
            ",".join(self.store.queues),
            ",".join(sorted(self.tasks.types)) or "none",
        )
        try:
            await self.store.start()
            await self._loop.run()
        finally:
            await self.store.close()
            self.sink.close()
            s = self.stats
            log.info(
                "worker %s stopped: done=%d retried=%d failed=%d released=%d lost_leases=%d",
                self.worker_id, s.done, s.retried, s.failed, s.released, s.lost_leases,
            )  # fmt: skip
