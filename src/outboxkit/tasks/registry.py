"""``Tasks``: the registry of handlers and the enqueue, inside the caller's transaction.

An enqueue runs the statements of the connection's database (its backend's: one statement,
backends/postgres/tasks_sql.py ``ENQUEUE``, on PostgreSQL; tasks/enqueue_mariadb.py on
MariaDB/MySQL) through the write side's driver adapters, so it refuses what ``Outbox.put``
refuses (autocommit, pools, sessions without a transaction) and commits or rolls back with
the caller's change, outbox events included.
``Tasks.transaction()`` sends the INSERTs with the COMMIT instead, through
``Outbox.transaction()``'s pipeline (write/commit.py; on MariaDB/MySQL write/mariadb_commit.py,
its multi-statement query and its ``max_allowed_packet`` split), reused, not copied."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import inspect
import math
import os
import re
import sys
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import orjson
import psycopg

from outboxkit.backends import Backend, backend_for, backend_of
from outboxkit.backends.ports import TaskAdmin
from outboxkit.drivers import Statement, Use, async_adapter, sync_adapter, type_name
from outboxkit.drivers.base import raw_async_adapter, raw_sync_adapter
from outboxkit.drivers.dbapi_adapter import DBAPIAsync, DBAPISync
from outboxkit.errors import InvalidEventError, transaction_conflict
from outboxkit.limits import DEFAULT_MAX_KEY_BYTES
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE
from outboxkit.tasks.enqueue_mariadb import MariaDBTaskEnqueue, MariaDBTaskStorage
from outboxkit.tasks.enqueue_pg import PgTaskEnqueue, PgTaskStorage, pg_task_row
from outboxkit.tasks.errors import InvalidTaskError
from outboxkit.tasks.function import Registrar, TaskFunction
from outboxkit.tasks.results import TaskResult, result_from_row, unstorable
from outboxkit.tasks.schedule import CatchUp, Cron, Periodic
from outboxkit.tracing import capture
from outboxkit.write.commit import AsyncOutboxTransaction, OutboxTransaction
from outboxkit.write.mariadb_commit import (
    AsyncMariaDBTransaction,
    BaseMariaDBTransaction,
    MariaDBTransaction,
    MySQLConnection,
)

if TYPE_CHECKING:
    from outboxkit.drivers import AsyncConnection, SyncConnection

_ENQUEUE = Use(
    action="enqueue a task",
    inside="enqueue inside its transaction",
    sync_methods="enqueue()",
    async_methods="`await aenqueue()`",
)
#: A payload's JSON text may not be larger (a task table is a queue, not a blob store).
MAX_PAYLOAD_BYTES = 1024 * 1024
#: Upstream tasks one task may wait for (``after=``); a larger fan-in chains.
MAX_UPSTREAM = 10_000
AfterFailure = Literal["cancel", "run"]
#: How long ``keep_result=True`` keeps a finished task's result by default: a day.
DEFAULT_KEEP_RESULTS = 86_400.0
_MAX_TEXT = 200  # task name, queue
_I16 = (-32768, 32767)
_I32_MAX = 2**31 - 1
#: key and unique_key, in UTF-8 bytes: each is in a btree index (whose row limit is 2 704
#: bytes), so a longer one aborted the caller's transaction; Event's default key limit.
MAX_KEY_BYTES = DEFAULT_MAX_KEY_BYTES

Handler = Callable[..., Any]
TaskEnqueue = PgTaskEnqueue | MariaDBTaskEnqueue
#: Each database's enqueue, by ``Backend.name``: here, not in backends/, as the outbox's
#: storages live in write/ (the layers put tasks above the backends and the drivers).
_ENQUEUERS: dict[str, Callable[[str], TaskEnqueue]] = {
    "postgresql": PgTaskEnqueue,
    "mariadb": MariaDBTaskEnqueue,
}


@dataclass(frozen=True, slots=True)
class TaskType:
    """One registered handler and how its tasks run."""

    name: str
    fn: Handler
    is_async: bool
    takes_context: bool
    model: type | None
    max_attempts: int
    retry_delays: tuple[float, ...]
    retry_base: float
    retry_cap: float
    timeout: float | None
    #: Lifecycle events' topic (completed, failed, dead-lettered), or None (tasks/lifecycle.py).
    events: str | None = None
    #: Seconds a finished task is kept with its return value (``keep_result``); None: not.
    keep: float | None = None
    #: At most this many of its tasks run at once across every worker (None: no limit).
    concurrency: int | None = None
    #: (starts per second, burst) across every worker (``rate="50/s"``); None: no limit.
    rate: tuple[float, int] | None = None
    #: At most this many of its tasks of one enqueue ``key`` run at once, in id order.
    concurrency_per_key: int = 1
    #: (starts per second, burst) per enqueue ``key`` (``rate_per_key="5/s"``); None: none.
    rate_per_key: tuple[float, int] | None = None
    #: Its keys served in turn (``fair=True``): at most FAIR_SHARE of a key claimable at once.
    fair: bool = False

    def decode(self, payload: Any) -> Any:
        """The stored JSON as the handler's declared type (a pydantic model or a dataclass)."""
        return _build(self.model, payload) if self.model is not None else payload


_RATE_UNITS = {"s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0, "hour": 3600.0}


def parse_rate(name: str, rate: str, option: str = "rate") -> tuple[float, int]:
    """``"50/s"`` -> (50.0 starts per second, burst 5): the burst is a tenth of a window's
    starts, at least 1 (a claim polls every so often: a bucket of one token would idle).
    ``option`` names the argument in the error (``rate``, ``rate_per_key``)."""
    if not isinstance(rate, str):
        raise ValueError(f"{option} of task {name!r} must be a string like '50/s', got {rate!r}")
    count, _sep, unit = rate.strip().partition("/")
    try:
        n = float(count)
        seconds = _RATE_UNITS[unit.strip().lower()]
    except (ValueError, KeyError):
        raise ValueError(
            f"{option} of task {name!r} must read like '50/s', '100/min' or '10/h', got {rate!r}"
        ) from None
    if not n > 0 or not math.isfinite(n):
        raise ValueError(f"{option} of task {name!r} must be above 0 and finite, got {rate!r}")
    return n / seconds, max(1, math.ceil(n / 10))


class Tasks:
    """Task mode on one table: ``@tasks.handler(name)`` registers, ``tasks.enqueue`` writes.

    ``outboxkit worker --app module:tasks`` runs the handlers (outboxkit.tasks.worker).
    ``max_attempts`` and the retry schedule are each handler's (its decorator), with these
    defaults; a task's own ``max_attempts`` (at enqueue) wins.
    """

    def __init__(
        self,
        table: str = DEFAULT_TASKS_TABLE,
        *,
        max_attempts: int = 10,
        notify: bool = True,
        keep_results_for: float | dt.timedelta = DEFAULT_KEEP_RESULTS,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.table = table
        self.max_attempts = max_attempts
        #: How long ``keep_result=True`` keeps a finished task's result (seconds).
        self.keep_results_for = _seconds("keep_results_for", keep_results_for)
        self.notify = notify
        self.types: dict[str, TaskType] = {}
        #: Periodic schedules by name, and their payloads encoded once (JSON text).
        self.schedules: dict[str, Periodic] = {}
        self.periodic_payloads: dict[str, str] = {}
        #: Each database's enqueue (its backend's), built at its first connection.
        self._enqueuers: dict[Backend, TaskEnqueue] = {}
        self._storage = PgTaskStorage(table, notify=notify)
        self._mariadb_storage = MariaDBTaskStorage(table)

    def __repr__(self) -> str:
        return f"Tasks(table={self.table!r}, handlers={sorted(self.types)!r})"

    # -- registry -------------------------------------------------------------------

    def handler(
        self,
        name: str,
        *,
        payload: type | None = None,
        max_attempts: int | None = None,
        retry: Sequence[float] | None = None,
        retry_base: float = 1.0,
        retry_cap: float = 300.0,
        timeout: float | None = None,
        events: str | None = None,
        keep_result: bool | float | dt.timedelta = False,
        concurrency: int | None = None,
        rate: str | None = None,
        concurrency_per_key: int = 1,
        rate_per_key: str | None = None,
        fair: bool = False,
    ) -> Registrar:
        """Register ``fn(payload)`` or ``fn(payload, ctx)``, sync or async, for ``name``.

        Returns the function as a :class:`~outboxkit.tasks.function.TaskFunction`: call it as
        before; ``fn.enqueue(conn, payload, ...)`` enqueues its task, the payload typed.

        ``payload``: a pydantic model or a dataclass, else read from the first parameter's
        annotation; a payload is validated against it at enqueue and built from it at run.
        ``retry``: the delays of the 1st, 2nd, ... retry (the last repeats); by default
        full-jitter exponential from ``retry_base`` up to ``retry_cap`` seconds.
        ``timeout``: seconds one run may take (an async handler is cancelled, a sync one's
        attempt is failed while its thread finishes); it counts as a failed attempt.
        ``events``: an outbox topic: each completed, failed and dead-lettered attempt becomes
        an event there (``task.completed`` ...), in the transaction of the state change.
        ``keep_result``: store the handler's return value (JSON) with its fenced completion
        and keep the finished task for ``Tasks(keep_results_for=)`` (True) or this long;
        read it with :meth:`result` / :meth:`wait`.
        ``concurrency``: at most this many of its tasks run at once across every worker,
        enforced by the claim in the database (docs/tasks.md "Concurrency limits").
        ``rate``: ``"R/s"``, ``"R/min"`` or ``"R/h"``: at most R starts in any such window
        across every worker, plus a burst of a tenth of R (at least 1); a task held back
        waits, spending no attempt (docs/tasks.md "Rate limits").
        ``concurrency_per_key``: at most this many of its tasks of one enqueue ``key`` run at
        once across every worker, a key's oldest first (1, the default: one at a time, in
        id order), enforced by the claim in the database.
        ``rate_per_key``: as ``rate``, for each enqueue ``key`` of its tasks on its own (a
        token bucket per key in the database; tasks without a key are not limited by it).
        ``fair``: its keys are served in turn: several tasks of a key run at once, but at
        most :data:`~outboxkit.queue.tasks.FAIR_SHARE` of a key are claimable, each behind
        the tasks due before it became claimable, so a key that floods holds another key's
        task back by about one claim (docs/tasks.md "Fairness between keys"). Not with
        ``concurrency_per_key``, which keeps a key's claimable tasks at N already.
        """
        pace = None if rate is None else parse_rate(name, rate)
        key_pace = None if rate_per_key is None else parse_rate(name, rate_per_key, "rate_per_key")
        _check_text("task name", name)
        if concurrency is not None and (isinstance(concurrency, bool) or concurrency < 1):
            raise ValueError(
                f"concurrency of task {name!r} must be at least 1, got {concurrency!r}"
            )
        if (
            not isinstance(concurrency_per_key, int)
            or isinstance(concurrency_per_key, bool)
            or not 1 <= concurrency_per_key <= _I16[1]
        ):
            raise ValueError(
                f"concurrency_per_key of task {name!r} must be an int from 1 to {_I16[1]},"
                f" got {concurrency_per_key!r}"
            )
        if not isinstance(fair, bool) or (fair and concurrency_per_key != 1):
            raise ValueError(
                f"fair of task {name!r} takes True or False, without concurrency_per_key"
                f" (a per-key limit keeps at most N of a key claimable already), got {fair!r}"
            )
        keep: float | None = None
        if keep_result is True:
            keep = self.keep_results_for
        elif keep_result is not False:
            keep = _seconds("keep_result", keep_result)
        if name in self.types:
            raise ValueError(f"task {name!r} already has a handler: {self.types[name].fn!r}")
        if retry is not None and (not retry or any(not d >= 0 for d in retry)):
            raise ValueError("retry takes one or more delays in seconds, each >= 0")
        attempts = self.max_attempts if max_attempts is None else max_attempts
        if attempts < 1:
            raise ValueError("max_attempts must be at least 1")

        def register(fn: Handler) -> TaskFunction[Any, Any]:
            if isinstance(fn, TaskFunction):  # another task's handler, registered again
                fn = fn.fn
            params = list(inspect.signature(fn).parameters.values())
            if not params:
                raise TypeError(f"handler {fn!r} of task {name!r} takes no payload parameter")
            model = payload if payload is not None else _annotated_model(fn, params[0].name)
            if model is not None and not _is_model(model):
                raise TypeError(
                    f"payload type of task {name!r} must be a pydantic model or a dataclass,"
                    f" got {model!r}"
                )
            self.types[name] = TaskType(
                name=name,
                fn=fn,
                is_async=inspect.iscoroutinefunction(fn),
                takes_context=len(params) >= 2,
                model=model,
                max_attempts=attempts,
                retry_delays=tuple(float(d) for d in retry or ()),
                retry_base=retry_base,
                retry_cap=retry_cap,
                timeout=timeout,
                events=events,
                keep=keep,
                concurrency=concurrency,
                rate=pace,
                concurrency_per_key=concurrency_per_key,
                rate_per_key=key_pace,
                fair=fair,
            )
            return TaskFunction(self, name, fn)

        return Registrar(register)

    def periodic_task(
        self,
        cron: str,
        name: str,
        payload: Any = None,
        *,
        schedule: str | None = None,
        catch_up: CatchUp = "last",
        queue: str = "default",
        priority: int = 0,
    ) -> None:
        """Run task ``name`` with ``payload`` at every slot of ``cron`` (UTC; 5 fields, or 6
        with a leading second), once per slot across every worker.

        ``catch_up``: slots missed while no worker ran: ``"last"`` runs the latest missed one
        once, ``"all"`` runs each (up to 1000), ``"none"`` skips them. ``schedule`` names the
        schedule (default ``"<name> <cron>"``): renaming it starts a new history.
        """
        if catch_up not in ("last", "all", "none"):
            raise ValueError(f"catch_up must be 'last', 'all' or 'none', got {catch_up!r}")
        parsed = Cron.parse(cron)
        key = schedule or f"{name} {cron}"
        if key in self.schedules:
            raise ValueError(f"periodic schedule {key!r} is registered twice")
        params = self._params(name, payload, None, None, None, priority, queue, None, None)
        self.schedules[key] = Periodic(key, parsed, name, payload, catch_up, queue, priority)
        self.periodic_payloads[key] = params[2]

    def periodic(
        self, cron: str, name: str | None = None, **options: Any
    ) -> Callable[[Handler], Handler]:
        """``@tasks.periodic("*/5 * * * *", "report.generate")``: register the function as the
        handler of ``name`` (default: its own name) and run it at every slot of ``cron``."""

        def register(fn: Handler) -> Handler:
            task_name = name or fn.__name__
            handler_options = {
                k: options.pop(k)
                for k in ("max_attempts", "retry", "timeout", "payload", "events", "keep_result")
                if k in options
            }
            if task_name not in self.types:
                self.handler(task_name, **handler_options)(fn)
            self.periodic_task(cron, task_name, **options)
            return fn

        return register

    # -- enqueue --------------------------------------------------------------------

    def enqueue(
        self,
        conn: SyncConnection,
        name: str,
        payload: Any = None,
        *,
        delay: float | dt.timedelta | None = None,
        run_at: dt.datetime | None = None,
        unique_key: str | None = None,
        priority: int = 0,
        queue: str = "default",
        key: str | None = None,
        max_attempts: int | None = None,
        after: Sequence[int] | None = None,
        after_failure: AfterFailure = "cancel",
    ) -> int | None:
        """Enqueue a task in ``conn``'s open transaction: its id, or None if a live task holds
        ``unique_key`` already (nothing inserted).

        A live (pending or running) task with the same ``unique_key`` makes this a no-op;
        if the transaction holding it is still open, this waits for it (and enqueues after
        all if it rolls back). ``delay`` or ``run_at``: not before then. ``key``: tasks of
        one key run one at a time, in enqueue order. Higher ``priority`` runs first.
        """
        enqueuer = self._enqueuer(conn)
        params = self._params(name, payload, delay, run_at, unique_key, priority, queue, key,
                              max_attempts)  # fmt: skip
        adapter = sync_adapter(conn, _ENQUEUE)
        if after:
            upstream, failure = self._after(params, after, after_failure)
            with _upstream_refusal():
                return _task_id(enqueuer.enqueue(adapter, conn, params, upstream, failure))
        return _task_id(enqueuer.enqueue(adapter, conn, params))

    async def aenqueue(
        self,
        conn: AsyncConnection,
        name: str,
        payload: Any = None,
        *,
        delay: float | dt.timedelta | None = None,
        run_at: dt.datetime | None = None,
        unique_key: str | None = None,
        priority: int = 0,
        queue: str = "default",
        key: str | None = None,
        max_attempts: int | None = None,
        after: Sequence[int] | None = None,
        after_failure: AfterFailure = "cancel",
    ) -> int | None:
        """Async :meth:`enqueue`: psycopg ``AsyncConnection``, asyncpg, SQLAlchemy async."""
        enqueuer = self._enqueuer(conn)
        params = self._params(name, payload, delay, run_at, unique_key, priority, queue, key,
                              max_attempts)  # fmt: skip
        adapter = async_adapter(conn, _ENQUEUE)
        if after:
            upstream, failure = self._after(params, after, after_failure)
            with _upstream_refusal():
                return _task_id(await enqueuer.aenqueue(adapter, conn, params, upstream, failure))
        return _task_id(await enqueuer.aenqueue(adapter, conn, params))

    def _enqueuer(self, conn: Any) -> TaskEnqueue:
        """The enqueue of ``conn``'s database (its backend's), built at its first use and
        kept: one ``Tasks`` serves connections of every database in one process."""
        backend = backend_of(conn)
        enqueuer = self._enqueuers.get(backend)
        if enqueuer is None:
            backend.refuse("tasks")
            enqueuer = self._enqueuers[backend] = _ENQUEUERS[backend.name](self.table)
        return enqueuer

    def _after(
        self, params: list[Any], after: Sequence[int], after_failure: str
    ) -> tuple[list[int], int]:
        """The upstream task ids, checked, and what a failed one does (0: cancel, 1: run)."""
        if after_failure not in ("cancel", "run"):
            raise InvalidTaskError(
                f"after_failure must be 'cancel' or 'run', got {after_failure!r}"
            )
        if isinstance(after, int | str) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in after
        ):
            raise InvalidTaskError(f"after takes task ids (positive ints), got {after!r:.80}")
        if params[4] is not None or params[5] is not None:
            raise InvalidTaskError(
                "after= does not combine with key= or unique_key= (a waiting task holds"
                " neither its key's turn nor its unique key)"
            )
        upstream = sorted(set(after))
        if len(upstream) > MAX_UPSTREAM:
            raise InvalidTaskError(
                f"after lists {len(upstream)} tasks, over the {MAX_UPSTREAM} limit: chain a"
                " task that waits for a batch of them"
            )
        return upstream, 0 if after_failure == "cancel" else 1

    # -- results --------------------------------------------------------------------

    def result(self, conn: psycopg.Connection[Any] | str, task_id: int) -> TaskResult | None:
        """Task ``task_id`` as it is now (state, value, error, progress, timings), or None if
        there is no such task (a finished task whose handler keeps no result is deleted).
        ``conn``: a psycopg connection (read in its transaction, if one is open) or a DSN."""
        row = _admin(conn).read_result(conn, self.table, _check_id(task_id))
        return None if row is None else result_from_row(row)

    def wait(
        self, conn: psycopg.Connection[Any] | str, task_id: int, *, timeout: float = 30.0
    ) -> TaskResult:
        """Block until task ``task_id`` is done, failed or cancelled; its :class:`TaskResult`.

        Woken by the completion's notification (LISTEN), not a tight loop; behind a
        transaction pooler it looks again with backoff (up to a second). ``conn``: a DSN or
        an autocommit psycopg connection. Raises ``TimeoutError`` naming the task's last
        state, and :class:`~outboxkit.errors.TaskNotFound` for an unknown task (or a finished
        one whose handler keeps no result: give it ``keep_result=True``)."""
        row = _admin(conn).wait_result(conn, self.table, _check_id(task_id), timeout)
        return result_from_row(row)

    async def await_result(
        self,
        conn: psycopg.AsyncConnection[Any] | str,
        task_id: int,
        *,
        timeout: float = 30.0,  # noqa: ASYNC109 (wait()'s signature: one API, sync or async)
    ) -> TaskResult:
        """:meth:`wait` for asyncio: a DSN or an autocommit ``psycopg.AsyncConnection``."""
        row = await _admin(conn).await_result(conn, self.table, _check_id(task_id), timeout)
        return result_from_row(row)

    def pause(self, conn: psycopg.Connection[Any] | str, queue: str) -> bool:
        """Stop every worker claiming from ``queue`` (running tasks finish; enqueue goes on);
        ``conn``: an autocommit connection or a DSN. False if it was paused already."""
        _check_text("queue", queue)
        return _admin(conn).pause_queue(conn, self.table, queue, by=f"Tasks.pause ({_process()})")

    def resume(self, conn: psycopg.Connection[Any] | str, queue: str) -> bool:
        """Let workers claim from ``queue`` again (waiting ones are woken at once); False if
        it was not paused."""
        _check_text("queue", queue)
        by = f"Tasks.resume ({_process()})"
        return _admin(conn).resume_queue(conn, self.table, queue, by=by)

    @overload
    def transaction(self, conn: psycopg.Connection[Any]) -> TaskTransaction: ...

    @overload
    def transaction(self, conn: MySQLConnection) -> MariaDBTaskTransaction: ...

    def transaction(self, conn: Any) -> TaskTransaction | MariaDBTaskTransaction:
        """A transaction whose tasks are inserted with its COMMIT, in its round trip.

        Use it instead of ``with conn.transaction():``; ``tx.enqueue(...)`` validates and
        queues. (A duplicate ``unique_key`` is skipped without being reported here.)
        On MariaDB/MySQL: a PyMySQL or mysqlclient connection, instead of your own
        BEGIN/``commit()``; the enqueues and the COMMIT travel as one multi-statement query,
        as ``Outbox.transaction()``'s events do (write/mariadb_commit.py).
        """
        return _SYNC_TRANSACTIONS[backend_of(conn).name](self, conn)

    @overload
    def atransaction(self, conn: psycopg.AsyncConnection[Any]) -> AsyncTaskTransaction: ...

    @overload
    def atransaction(self, conn: MySQLConnection) -> AsyncMariaDBTaskTransaction: ...

    def atransaction(self, conn: Any) -> AsyncTaskTransaction | AsyncMariaDBTaskTransaction:
        """:meth:`transaction` for psycopg ``AsyncConnection`` (aiomysql or asyncmy on
        MariaDB/MySQL): ``async with``."""
        return _ASYNC_TRANSACTIONS[backend_of(conn).name](self, conn)

    def _params(
        self,
        name: str,
        payload: Any,
        delay: float | dt.timedelta | None,
        run_at: dt.datetime | None,
        unique_key: str | None,
        priority: int,
        queue: str,
        key: str | None,
        max_attempts: int | None,
    ) -> list[Any]:
        """The enqueue's parameters (``ENQUEUE_COLUMNS`` order, available_at as a run-at time
        and a delay), checked; each database's enqueue runs them (tasks/enqueue_*.py)."""
        task_type = self.types.get(name)
        if task_type is None:
            known = ", ".join(sorted(self.types)) or "none"
            raise InvalidTaskError(
                f"no handler is registered for task {name!r} in this process"
                f" ({_process()}; registered: {known}): the process that enqueues needs it"
                " too, to check the payload. Register it with @tasks.handler(name) in a module"
                " this process imports (with Django: the app's tasks.py, imported at start-up)"
            )
        document = _encode(task_type, payload)
        _check_text("queue", queue)
        if (
            not isinstance(priority, int)
            or isinstance(priority, bool)
            or not _I16[0] <= priority <= _I16[1]
        ):
            raise InvalidTaskError(f"priority must be an int in {_I16}, got {priority!r}")
        if max_attempts is not None and (
            not isinstance(max_attempts, int)
            or isinstance(max_attempts, bool)
            or not 1 <= max_attempts <= _I32_MAX
        ):
            raise InvalidTaskError(
                f"max_attempts must be an int from 1 to {_I32_MAX}, got {max_attempts!r}"
            )
        _check_key("key", key)
        _check_key("unique_key", unique_key)
        at, seconds = _run_at(delay, run_at)
        return [name, queue, document, priority, key, unique_key, max_attempts, at, seconds,
                _trace()]  # fmt: skip


# -- tasks sent with the COMMIT --------------------------------------------------------


def _check_event(event: object) -> Any:
    raise InvalidEventError(
        "a task transaction takes tasks (tx.enqueue); write events with outbox.put() in it"
    )


class EnqueuedTask:
    """What ``tx.enqueue`` returns: the task's :attr:`id`, known once the transaction has
    committed (the INSERT travels with the COMMIT, so there is no id before it)."""

    __slots__ = ("_id", "_known")

    def __init__(self) -> None:
        self._id: int | None = None
        self._known = False

    @property
    def id(self) -> int | None:
        """The new task's id; None if a live task held its ``unique_key`` (skipped)."""
        if not self._known:
            raise RuntimeError(
                "the task's id is known once its transaction has committed (the INSERT is"
                " sent with the COMMIT): read it after the `with tasks.transaction()` block"
            )
        return self._id

    def __repr__(self) -> str:
        return f"EnqueuedTask(id={self._id!r})" if self._known else "EnqueuedTask(not committed)"


def _assign(handles: list[EnqueuedTask], values: list[bytes | None]) -> None:
    for handle, value in zip(handles, values, strict=True):
        handle._id = None if value is None else int(value)
        handle._known = True


class TaskTransaction(OutboxTransaction):
    """``with tasks.transaction(conn) as tx:``: ``tx.enqueue(...)`` rides with the COMMIT."""

    _reads_values = True

    def __init__(self, tasks: Tasks, conn: psycopg.Connection[Any]) -> None:
        super().__init__(tasks._storage, _check_event, conn)
        self._tasks = tasks
        self._handles: list[EnqueuedTask] = []

    def __enter__(self) -> TaskTransaction:
        super().__enter__()
        return self

    def enqueue(self, name: str, payload: Any = None, **options: Any) -> EnqueuedTask:
        """Validate and queue a task (:meth:`Tasks.enqueue`'s options): sent with the COMMIT.
        Its id is the handle's ``.id`` once the block has committed."""
        self._require_active()
        self._rows.append(pg_task_row(_options(self._tasks, name, payload, options)))
        handle = EnqueuedTask()
        self._handles.append(handle)
        return handle

    def _committed(self, values: list[bytes | None]) -> None:
        _assign(self._handles, values)
        self._handles = []


class AsyncTaskTransaction(AsyncOutboxTransaction):
    """:class:`TaskTransaction` with ``async with``."""

    _reads_values = True

    def __init__(self, tasks: Tasks, conn: psycopg.AsyncConnection[Any]) -> None:
        super().__init__(tasks._storage, _check_event, conn)
        self._tasks = tasks
        self._handles: list[EnqueuedTask] = []

    async def __aenter__(self) -> AsyncTaskTransaction:
        await super().__aenter__()
        return self

    def enqueue(self, name: str, payload: Any = None, **options: Any) -> EnqueuedTask:
        self._require_active()
        self._rows.append(pg_task_row(_options(self._tasks, name, payload, options)))
        handle = EnqueuedTask()
        self._handles.append(handle)
        return handle

    def _committed(self, values: list[bytes | None]) -> None:
        _assign(self._handles, values)
        self._handles = []


class _MariaDBTaskRows(BaseMariaDBTransaction[Any]):
    """What both MariaDB/MySQL task transactions change of the outbox's: task rows (one
    ``INSERT … RETURNING id`` each) instead of events, their ids read back after the COMMIT,
    and a task's refusal in a task's words."""

    _tasks: Tasks
    _handles: list[EnqueuedTask]
    #: Whether the connection takes several statements in one query (PyMySQL only when
    #: opened with CLIENT.MULTI_STATEMENTS): without, one statement per task.
    _multi = True
    _what = "Tasks.transaction()"

    def enqueue(self, name: str, payload: Any = None, **options: Any) -> EnqueuedTask:
        """Validate and queue a task (:meth:`Tasks.enqueue`'s options): sent with the COMMIT.
        Its id is the handle's ``.id`` once the block has committed."""
        self._require_active()
        params = _options(self._tasks, name, payload, options)
        self._queue([self._tasks._mariadb_storage.row(params)])
        handle = EnqueuedTask()
        self._handles.append(handle)
        return handle

    def _statements(self, limit: int | None) -> list[tuple[Statement, list[Any]]]:
        statements = super()._statements(limit)  # (a task too large is refused here)
        if self._multi or len(self._rows) < 2:
            return statements
        return [self._storage.insert([row]) for row in self._rows]

    def _too_large(self, position: int, row: tuple[Any, ...], size: int, limit: int) -> Exception:
        return InvalidTaskError(
            f"task #{position + 1} of this transaction ({row[1]!r}) takes {size} bytes in its"
            f" INSERT, more than the server's max_allowed_packet of {limit} bytes: nothing of"
            " this transaction was sent. Raise max_allowed_packet (SET GLOBAL"
            " max_allowed_packet = …, for new connections) or enqueue a reference to the"
            " payload instead"
        )

    def _committed(self, values: list[Any]) -> None:
        _assign(self._handles, values)
        self._handles = []

    def _woke(self) -> None:
        self._tasks._mariadb_storage.committed(self._rows)

    def _failed(self, exc: BaseException) -> BaseException:
        conflict = (
            transaction_conflict(exc, rolled_back=True) if isinstance(exc, Exception) else None
        )
        return conflict if conflict is not None else exc


class MariaDBTaskTransaction(_MariaDBTaskRows, MariaDBTransaction):
    """``with tasks.transaction(conn) as tx`` on PyMySQL or mysqlclient."""

    def __init__(self, tasks: Tasks, conn: Any, adapter: DBAPISync) -> None:
        super().__init__(tasks._mariadb_storage, _check_event, conn, adapter)
        self._tasks = tasks
        self._handles = []
        self._multi = adapter.multi_statements(conn)

    def __enter__(self) -> MariaDBTaskTransaction:
        super().__enter__()
        return self


class AsyncMariaDBTaskTransaction(_MariaDBTaskRows, AsyncMariaDBTransaction):
    """:class:`MariaDBTaskTransaction` with ``async with``: aiomysql or asyncmy."""

    def __init__(self, tasks: Tasks, conn: Any, adapter: DBAPIAsync) -> None:
        super().__init__(tasks._mariadb_storage, _check_event, conn, adapter)
        self._tasks = tasks
        self._handles = []

    async def __aenter__(self) -> AsyncMariaDBTaskTransaction:
        await super().__aenter__()
        return self


def _pg_transaction(tasks: Tasks, conn: Any) -> TaskTransaction:
    if not isinstance(conn, psycopg.Connection):
        raise TypeError(f"Tasks.transaction() needs a psycopg.Connection, got {type_name(conn)}")
    return TaskTransaction(tasks, conn)


def _pg_atransaction(tasks: Tasks, conn: Any) -> AsyncTaskTransaction:
    if not isinstance(conn, psycopg.AsyncConnection):
        raise TypeError(
            f"Tasks.atransaction() needs a psycopg.AsyncConnection, got {type_name(conn)}"
        )
    return AsyncTaskTransaction(tasks, conn)


def _no_mariadb_transaction(conn: Any, method: str, expected: str) -> TypeError:
    return TypeError(
        f"Tasks.{method}() on MariaDB/MySQL needs a {expected} connection, got"
        f" {type_name(conn)}; elsewhere (SQLAlchemy) use tasks.enqueue() inside your own"
        " transaction"
    )


def _mariadb_transaction(tasks: Tasks, conn: Any) -> MariaDBTaskTransaction:
    adapter = raw_sync_adapter(conn)
    if not isinstance(adapter, DBAPISync):
        raise _no_mariadb_transaction(conn, "transaction", "PyMySQL or mysqlclient")
    return MariaDBTaskTransaction(tasks, conn, adapter)


def _mariadb_atransaction(tasks: Tasks, conn: Any) -> AsyncMariaDBTaskTransaction:
    adapter = raw_async_adapter(conn)
    if not isinstance(adapter, DBAPIAsync):
        raise _no_mariadb_transaction(conn, "atransaction", "aiomysql or asyncmy")
    return AsyncMariaDBTaskTransaction(tasks, conn, adapter)


#: ``Tasks.transaction()`` / ``atransaction()`` of each database, by ``Backend.name``.
_SYNC_TRANSACTIONS: dict[str, Callable[[Tasks, Any], TaskTransaction | MariaDBTaskTransaction]] = {
    "postgresql": _pg_transaction,
    "mariadb": _mariadb_transaction,
}
_ASYNC_TRANSACTIONS: dict[
    str, Callable[[Tasks, Any], AsyncTaskTransaction | AsyncMariaDBTaskTransaction]
] = {
    "postgresql": _pg_atransaction,
    "mariadb": _mariadb_atransaction,
}


def _options(tasks: Tasks, name: str, payload: Any, options: dict[str, Any]) -> list[Any]:
    if "after" in options or "after_failure" in options:
        raise TypeError(
            "after= is not taken inside tasks.transaction() (its INSERTs travel with the"
            " COMMIT, with no upstream checks): use tasks.enqueue(conn, ...) in the block"
        )
    allowed = {"delay", "run_at", "unique_key", "priority", "queue", "key", "max_attempts"}
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"enqueue() got unexpected option(s): {', '.join(sorted(unknown))}")
    return tasks._params(
        name,
        payload,
        options.get("delay"),
        options.get("run_at"),
        options.get("unique_key"),
        options.get("priority", 0),
        options.get("queue", "default"),
        options.get("key"),
        options.get("max_attempts"),
    )


@contextlib.contextmanager
def _upstream_refusal() -> Iterator[None]:
    """ENQUEUE_AFTER fails its statement when an upstream id is unknown (nothing is written;
    the caller's transaction is aborted): say so in words."""
    try:
        yield
    except Exception as exc:
        found = re.search(r"outboxkit: no upstream task ([0-9, ]+)", str(exc))
        if found is None:
            raise
        raise InvalidTaskError(
            f"after= names task(s) {found.group(1)} that do not exist: never enqueued, or"
            " finished and deleted already (enqueue a task's dependents in the transaction"
            " that enqueues it, or give its handler keep_result so it stays); nothing was"
            " written and the transaction is aborted"
        ) from exc


def _check_id(task_id: object) -> int:
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 1:
        raise InvalidTaskError(
            f"a task id is a positive int (what enqueue returned), got {task_id!r}"
        )
    return task_id


def _seconds(what: str, value: object) -> float:
    """A duration in seconds (a number or a timedelta), positive and at most ten years."""
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} takes seconds or a timedelta, got {value!r}")
    if not 0 < value <= 10 * 365 * 86400:
        raise ValueError(f"{what} must be more than 0 s and at most ten years, got {value}")
    return float(value)


def _admin(conn: object) -> TaskAdmin:
    """The task reads and switches of ``conn``'s database (a URL or a connection)."""
    backend = backend_for(conn) if isinstance(conn, str) else backend_of(conn)
    return backend.task_admin()


def _trace() -> str | None:
    """The active span's W3C traceparent, or None (a dict lookup when OpenTelemetry was
    never imported: tracing.capture)."""
    headers: dict[str, str] = {}
    capture(headers)
    return headers.get("traceparent")


def _task_id(value: Any) -> int | None:
    """The enqueue's result as an id (drivers give an int; a text-mode one a str)."""
    return None if value is None else int(value)


# -- payloads ------------------------------------------------------------------------------


def _is_model(cls: object) -> bool:
    return isinstance(cls, type) and (
        dataclasses.is_dataclass(cls) or hasattr(cls, "model_validate")
    )


def _annotated_model(fn: Handler, param: str) -> type | None:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: treat the payload as plain JSON
        return None
    hint = hints.get(param)
    return hint if _is_model(hint) else None


def _build(model: type, value: Any) -> Any:
    """``value`` (an instance or its JSON form) as ``model``, validated."""
    if isinstance(value, model):
        return value
    validate = getattr(model, "model_validate", None)
    if validate is not None:
        return validate(value)
    if not isinstance(value, dict):
        raise TypeError(
            f"expected {model.__name__} or a dict of its fields, got {type_name(value)}"
        )
    return model(**value)


def _encode(task_type: TaskType, payload: Any) -> str:
    """The payload as JSON text, validated against the handler's model: refused here, never
    in the worker (the caller's transaction is untouched: nothing was sent)."""
    try:
        value: Any = payload
        if task_type.model is not None:
            built = _build(task_type.model, payload)
            dump = getattr(built, "model_dump", None)
            value = dump(mode="json") if dump is not None else dataclasses.asdict(built)
        text = orjson.dumps(value).decode()
    except Exception as exc:
        raise InvalidTaskError(
            f"payload of task {task_type.name!r} is invalid: {type(exc).__name__}: {exc}"
        ) from None
    # orjson writes NaN and infinities as null, and PostgreSQL's jsonb refuses \u0000 (the
    # caller's transaction aborted): look closer only when the text shows either.
    if "null" in text or "\\u0000" in text:
        problem = unstorable(value, "payload")
        if problem is not None:
            raise InvalidTaskError(f"{problem} in task {task_type.name!r}: nothing was sent")
    if len(text) > MAX_PAYLOAD_BYTES:
        raise InvalidTaskError(
            f"payload of task {task_type.name!r} is {len(text)} bytes of JSON, over the"
            f" {MAX_PAYLOAD_BYTES} limit: store the data elsewhere and enqueue its id"
        )
    return text


def _process() -> str:
    """This process as a person finds it in `ps`: its program and pid."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return f"{program}, pid {os.getpid()}"


def _check_text(what: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > _MAX_TEXT or "\x00" in value:
        raise InvalidTaskError(
            f"{what} must be a str of 1 to {_MAX_TEXT} characters, without NUL: {value!r}"
        )


def _check_key(what: str, value: object) -> None:
    """A key is indexed: over a btree row's size PostgreSQL aborts the caller's transaction."""
    if value is None:
        return
    if not isinstance(value, str) or not value or "\x00" in value:
        raise InvalidTaskError(f"{what} must be a non-empty str without NUL, got {value!r:.80}")
    size = len(value.encode())
    if size > MAX_KEY_BYTES:
        raise InvalidTaskError(
            f"{what} is {size} bytes, over the {MAX_KEY_BYTES}-byte limit: use a digest of it"
        )


def _run_at(
    delay: float | dt.timedelta | None, run_at: dt.datetime | None
) -> tuple[dt.datetime | None, float]:
    """(run_at, delay in seconds): the insert adds a delay to the database's clock."""
    if delay is not None and run_at is not None:
        raise InvalidTaskError("give delay or run_at, not both")
    if run_at is not None:
        if run_at.tzinfo is None:
            raise InvalidTaskError("run_at must be timezone-aware (a naive time is ambiguous)")
        return run_at, 0.0
    if delay is None:
        return None, 0.0
    seconds = delay.total_seconds() if isinstance(delay, dt.timedelta) else float(delay)
    if not 0 <= seconds <= 365 * 86400:
        raise InvalidTaskError(f"delay must be between 0 and a year, got {seconds}s")
    return None, seconds
