"""The handler sink: what the queue core's claim loop hands claimed tasks to, in task mode.

It plays the publisher's part in the relay (outboxkit.queue.loop.Sink): each claimed task
runs its registered handler and becomes an outcome value for ``decide()``: done, a failure
retried on the handler's schedule, ``Fail`` (dead at once), ``Retry``/``Snooze``
(``Reschedule``: the handler's own time). Sync handlers run in the sink's threads, so a
CPU-bound one never blocks the event loop that runs the lease heartbeat.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import threading
import traceback
import uuid
from collections.abc import Sequence

from outboxkit._redact import redact
from outboxkit.queue.decide import Outcome, Reschedule
from outboxkit.queue.tasks import ClaimedTask, TaskStore, UndecodablePayload
from outboxkit.tasks.context import TaskContext
from outboxkit.tasks.outcomes import SUCCESS, Fail, Retry, Snooze, TaskOutcome
from outboxkit.tasks.progress import ProgressWriter
from outboxkit.tasks.registry import Tasks
from outboxkit.tasks.results import ResultError, encode_result
from outboxkit.tracing import task_outcome, task_span, task_span_wanted
from outboxkit.write.outbox import Outbox

#: A stored traceback keeps its last lines, up to this many characters.
MAX_TRACEBACK_CHARS = 4000
#: A sync task this worker cannot start (every spare thread abandoned) goes back to the
#: queue for this many seconds, its attempt refunded: another worker takes it meanwhile.
HAND_BACK_DELAY = 5.0

log = logging.getLogger("outboxkit.worker")


class HandlerSink:
    """Runs each claimed task's handler; one outcome per task, never raises for a task."""

    name = "handlers"

    def __init__(
        self,
        tasks: Tasks,
        *,
        store: TaskStore,
        threads: int,
        outbox: Outbox | None = None,
        worker_id: str = "",
    ) -> None:
        self.tasks = tasks
        self.store = store  # ctx.transaction()'s connections and fenced completion
        self.worker_id = worker_id
        self.outbox = outbox if outbox is not None else Outbox()
        self._running: dict[int, asyncio.Task[Outcome]] = {}  # by task id
        self._lost: set[asyncio.Task[Outcome]] = set()
        # A sync handler past its timeout cannot be stopped (a thread cannot be killed): its
        # thread is abandoned and another takes its slot, up to `max_abandoned` spares;
        # past that the worker is degraded and hands its sync tasks to other workers.
        self.max_abandoned = max(2 * threads, 8)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads + self.max_abandoned, thread_name_prefix="outboxkit-task"
        )
        self._busy: set[concurrent.futures.Future[object]] = set()  # handlers in threads
        self._abandoned: set[concurrent.futures.Future[object]] = set()
        self._threads_lock = threading.Lock()
        self._degraded_said = False
        #: ctx.progress() values, written together every so often.
        self.progress = ProgressWriter(store)
        #: A span per task run (OpenTelemetry with an SDK configured, checked at start).
        self._traced = task_span_wanted()

    def close(self) -> None:
        """Stop the threads (a sync handler past its timeout finishes on its own)."""
        self.progress.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def threads_running(self) -> int:
        """Sync handlers still running in a thread (abandoned ones included)."""
        with self._threads_lock:
            return len(self._busy)

    def degraded_reason(self) -> str | None:
        """Why this worker cannot start sync tasks now, or None."""
        with self._threads_lock:
            abandoned = len(self._abandoned)
        if abandoned < self.max_abandoned:
            return None
        return (
            f"{abandoned} sync handler thread(s) still running past their timeout (at most"
            f" {self.max_abandoned} are replaced): sync tasks are handed to other workers"
        )

    def _submit(self, call: functools.partial[object]) -> concurrent.futures.Future[object]:
        future = self._pool.submit(call)
        with self._threads_lock:
            self._busy.add(future)
        future.add_done_callback(self._thread_returned)
        return future

    def _thread_returned(self, future: concurrent.futures.Future[object]) -> None:
        with self._threads_lock:
            self._busy.discard(future)
            was_abandoned = future in self._abandoned
            self._abandoned.discard(future)
            left = len(self._abandoned)
        if was_abandoned:
            self._degraded_said = False
            log.info("an abandoned sync handler returned at last (%d still running)", left)

    def _abandon(self, task: ClaimedTask, future: concurrent.futures.Future[object]) -> None:
        with self._threads_lock:
            if future.done():
                return
            self._abandoned.add(future)
            count = len(self._abandoned)
        log.warning(
            "task %d (%s): its sync handler runs on past its timeout; its thread is abandoned"
            " and replaced (%d of at most %d abandoned)",
            task.id, task.task_name, count, self.max_abandoned,
        )  # fmt: skip

    async def process(self, token: uuid.UUID, items: Sequence[ClaimedTask]) -> Sequence[Outcome]:
        self.progress.loop = asyncio.get_running_loop()
        if len(items) == 1:  # the worker's split path: run in the calling runner's task (a
            # task and a gather less per task; lost() cancels it only while this one runs)
            task, current = items[0], asyncio.current_task()
            assert current is not None
            self._running[task.id] = current
            try:
                return [await self._run(token, task)]
            finally:
                self._running.pop(task.id, None)
                if self._lost and current in self._lost:
                    # Its handler swallowed the cancel of its lost task: the runner goes on
                    # to other tasks, so it must not stay marked (nor its cancel counted).
                    self._lost.discard(current)
                    current.uncancel()
        runs = [asyncio.create_task(self._run(token, t)) for t in items]
        for task, run in zip(items, runs, strict=True):
            self._running[task.id] = run
        try:
            return await asyncio.gather(*runs)
        finally:
            for task in items:
                self._running.pop(task.id, None)

    def lost(self, ids: Sequence[int]) -> None:
        """These tasks are no longer this worker's (cancelled by an operator, or re-claimed
        after the lease ran out): stop their handlers. An async handler gets
        ``CancelledError``; a sync one sees ``ctx.cancelled`` set (a thread cannot be stopped)."""
        for task_id in ids:
            run = self._running.get(task_id)
            if run is not None:
                self._lost.add(run)
                run.cancel()

    async def _run(self, token: uuid.UUID, task: ClaimedTask) -> Outcome:
        if not self._traced:
            return await self._run_task(token, task)
        attributes = {"outboxkit.task.id": task.id, "outboxkit.task.name": task.task_name,
                      "outboxkit.task.attempt": task.attempt, "messaging.system": "outboxkit",
                      "messaging.destination.name": task.queue}  # fmt: skip
        with task_span(task.task_name, task.trace, attributes) as span:
            outcome = await self._run_task(token, task)
            task_outcome(span, outcome.ok, getattr(outcome, "error", None))
            return outcome

    async def _run_task(self, token: uuid.UUID, task: ClaimedTask) -> Outcome:
        if isinstance(task.payload, UndecodablePayload):
            task.error_type = "UndecodablePayload"
            return TaskOutcome(
                False,
                f"the stored payload does not decode ({task.payload.reason}): the row was"
                " written around tasks.enqueue(); fix its payload and `outboxkit tasks replay`"
                " it, or discard it",
                retryable=False,
            )
        task_type = self.tasks.types.get(task.task_name)
        if task_type is None:
            task.error_type = "UnknownTask"
            return TaskOutcome(
                False,
                f"no handler is registered for task {task.task_name!r} in this worker: deploy"
                " a worker whose --app registers it, then `outboxkit tasks replay`",
                retryable=False,
            )
        task.keep = task_type.keep
        # The context only for handlers that take one: it costs a threading.Event, a
        # quarter of the worker's CPU per no-op task when built for every task.
        ctx = None
        if task_type.takes_context:
            ctx = TaskContext(
                task,
                token,
                store=self.store,
                outbox=self.outbox,
                worker_id=self.worker_id,
                events=task_type.events,
                progress=self.progress,
            )
        thread: concurrent.futures.Future[object] | None = None
        value: object = None
        try:
            payload = task_type.decode(task.payload)
            args = (payload,) if ctx is None else (payload, ctx)
            if task_type.is_async:
                run = task_type.fn(*args)
            else:
                reason = self.degraded_reason()
                if reason is not None:
                    return self._hand_back(reason)
                call = functools.partial(contextvars.copy_context().run, task_type.fn, *args)
                thread = self._submit(call)
                run = asyncio.wrap_future(thread)
            if task_type.timeout is not None:
                async with asyncio.timeout(task_type.timeout):
                    value = await run
            else:
                value = await run
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is None or current not in self._lost:
                raise  # the worker is stopping: the loop hands the task back
            self._lost.discard(current)
            current.uncancel()  # (run inline, the task goes on: to the settle)
            if ctx is not None:
                ctx.cancelled.set()
            task.error_type = "Cancelled"
            return TaskOutcome(
                False, "the task was cancelled, or re-claimed elsewhere, while it ran"
            )
        except Snooze as snooze:
            return Reschedule(snooze.delay, counts_attempt=False)
        except Retry as retry:
            task.error_type = "Retry"
            return Reschedule(retry.delay, error=retry.reason)
        except Fail as fail:
            task.error_type = "Fail"
            return TaskOutcome(False, redact(fail.reason), retryable=False)
        except TimeoutError as exc:
            if ctx is not None:  # a sync handler's thread goes on: tell it to stop
                ctx.cancelled.set()
            if thread is not None:
                self._abandon(task, thread)
            task.error_type = "Timeout"
            task.traceback = _excerpt(exc)
            return TaskOutcome(
                False, f"the handler ran longer than its timeout of {task_type.timeout}s"
            )
        except GeneratorExit:
            raise  # the coroutine is being closed, not a handler's failure
        except BaseException as exc:  # SystemExit, KeyboardInterrupt and their kin too
            # A handler's SystemExit or KeyboardInterrupt is its failure, not the worker's:
            # let it escape and the process exits, the shutdown refunds the attempt, and a
            # supervisor restarts the worker into the same poison for ever. A real signal to
            # the worker never arrives here (the loop's signal handlers stop the worker).
            task.error_type = type(exc).__name__
            task.traceback = _excerpt(exc)
            return TaskOutcome(False, redact(f"{type(exc).__name__}: {exc}"))
        if task.keep is not None:
            task.progress = self.progress.take(task.id)
            try:
                task.result = encode_result(task.task_name, value)
            except ResultError as exc:
                if task.completed:  # its transaction committed: the task is done, valueless
                    log.error("task %d: %s; it completed without a stored result", task.id, exc)
                    return SUCCESS
                task.error_type = "ResultError"
                return TaskOutcome(False, redact(str(exc)))
        return SUCCESS

    def _hand_back(self, reason: str) -> Outcome:
        if not self._degraded_said:
            self._degraded_said = True
            log.warning("worker degraded: %s", reason)
        return Reschedule(HAND_BACK_DELAY, counts_attempt=False)

    # -- the rest of the core's Sink protocol: a handler has no target to be down ---------

    def target_down(self) -> bool:
        return False

    def restored_since(self, when: float) -> bool:
        return False

    def dead_outcome(self, error: str, error_class: str) -> Outcome:
        return TaskOutcome(False, error, retryable=False)


def _excerpt(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return redact(text[-MAX_TRACEBACK_CHARS:])
