"""The backends the task-store contract runs on, behind one small harness each.

A scenario enqueues tasks, claims, settles and completes them through the task-store port
only (outboxkit.queue.tasks.TaskStore), and reads a task's state back (:class:`TaskRow`)
through the harness. Time moves by :meth:`TaskBackend.advance`: the in-memory clock moves;
PostgreSQL's stored times move back by as much, which is the same to every statement that
compares them with ``now()``. A new backend joins with one subclass here and its name in
``TASK_BACKENDS`` (conftest.py).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

import psycopg

from outboxkit.backends.ports import Feature
from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.tasks_pg import PgTaskStore
from outboxkit.backends.postgres.tasks_sql import TaskStatements
from outboxkit.queue.memory import ManualClock
from outboxkit.queue.memory_tasks import MemoryTasks, MemoryTaskStore
from outboxkit.queue.tasks import TaskClaim, TaskClaimed, TaskStore
from outboxkit.tasks import Tasks

StatusName = Literal["pending", "running", "done", "failed", "cancelled", "waiting"]
_STATUS: dict[int, StatusName] = {
    0: "pending", 1: "running", 2: "done", 3: "failed", 4: "cancelled", 5: "waiting",
}  # fmt: skip
TABLE = "contract_tasks"
#: The outbox table lifecycle events go to (``TaskBackend.lifecycle_store``).
OUTBOX = "contract_outbox"


@dataclasses.dataclass(frozen=True)
class TaskRow:
    """A task's stored state; ``due``: its ``available_at`` has come (run-at or lease)."""

    status: StatusName
    attempts: int
    lapses: int
    spared: int
    due: bool
    claim_token: uuid.UUID | None
    last_error: str | None
    error_type: str | None
    #: The stored result and progress, decoded (None: none); ``kept``: kept for its result.
    result: Any = None
    progress: Any = None
    kept: bool = False


class TaskBackend(abc.ABC):
    """One backend's task table and the stores (workers) claiming from it."""

    name: str
    #: Its store parks the tasks behind a full concurrency limit out of the claim's way
    #: (status waiting): an optimisation only, so a store that does not still keeps the
    #: limit and the order, and the contract reads the states only where it parks.
    parks = True
    #: Its enqueue knows the fair names (the workers' row of ``<table>_fair``): a fair key's
    #: task is pending at once while its key has room. Without it the task waits for the
    #: next promotion (a claim or settle of its key, or the sweep), fair all the same.
    fair_enqueue = True

    def __init__(self) -> None:
        self._stores: list[TaskStore] = []

    def lacks(self, feature: Feature) -> str | None:
        """Why this backend cannot do ``feature`` (its Backend's ``cannot``); None: it can."""
        return None

    @abc.abstractmethod
    async def enqueue(
        self,
        name: str = "job",
        *,
        queue: str = "default",
        priority: int = 0,
        key: str | None = None,
        max_attempts: int | None = None,
        delay: float = 0.0,
        after: Sequence[int] = (),
        after_failure: int = 0,
    ) -> int:
        """One pending task due after ``delay`` seconds (waiting for ``after``); its id."""

    def store(
        self,
        *,
        queues: Sequence[str] = ("default",),
        names: Sequence[str] | None = None,
        retention: Literal["delete", "keep"] = "delete",
        per_key: dict[str, int] | None = None,
        fair: Sequence[str] = (),
        fair_share: int = 3,
    ) -> TaskStore:
        """A new worker's store on the table (closed after the test); ``per_key``: its
        names' ``concurrency_per_key``; ``fair``: its names with ``fair=True``, each key's
        ``fair_share`` pending at once."""
        store = self._make_store(list(queues), names, retention, per_key or {}, fair, fair_share)
        self._stores.append(store)
        return store

    @abc.abstractmethod
    def _make_store(
        self,
        queues: list[str],
        names: Sequence[str] | None,
        retention: Literal["delete", "keep"],
        per_key: dict[str, int],
        fair: Sequence[str] = (),
        fair_share: int = 3,
    ) -> TaskStore: ...

    @abc.abstractmethod
    async def row(self, task_id: int) -> TaskRow | None:
        """The task's state; None once it was deleted."""

    @abc.abstractmethod
    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for every lease and run-at time."""

    async def close(self) -> None:
        for store in self._stores:
            await store.close()

    def lifecycle_store(self, tasks: Tasks) -> TaskStore | None:
        """A store whose settles write ``tasks``' lifecycle events to :data:`OUTBOX`, as
        the worker's (None: this backend's stores write no outbox)."""
        return None

    async def events(self) -> list[tuple[str, int]]:
        """The lifecycle events in :data:`OUTBOX`, in id order: (event type, task id)."""
        raise NotImplementedError


async def claim(
    store: TaskStore,
    *,
    limit: int = 10,
    lease: float = 30.0,
    queue: str = "default",
    alone: bool = False,
    max_attempts: int = 3,
    token: uuid.UUID | None = None,
    name: str | None = None,
    concurrency: int | None = None,
    skip: tuple[str, ...] = (),
    rate: float | None = None,
    burst: int = 1,
    per_key: int = 1,
    key_rate: float | None = None,
    key_burst: int = 1,
    fair: int | None = None,
) -> TaskClaimed:
    """One claim statement, as the core's claim policies issue it."""
    what = TaskClaim(
        queue, alone=alone, name=name, concurrency=concurrency, skip=skip, rate=rate,
        burst=burst, per_key=per_key, key_rate=key_rate, key_burst=key_burst, fair=fair,
    )  # fmt: skip
    return await store.claim_tasks(
        what, limit=limit, lease=lease, token=token or uuid.uuid4(),
        owner="contract", max_attempts=max_attempts,
    )  # fmt: skip


class MemoryTaskBackend(TaskBackend):
    name = "memory"

    def __init__(self, store_class: Callable[..., MemoryTaskStore] = MemoryTaskStore) -> None:
        super().__init__()
        self.clock = ManualClock(1_000.0)
        self.tasks = MemoryTasks(clock=self.clock)
        self.store_class = store_class

    async def enqueue(
        self,
        name: str = "job",
        *,
        queue: str = "default",
        priority: int = 0,
        key: str | None = None,
        max_attempts: int | None = None,
        delay: float = 0.0,
        after: Sequence[int] = (),
        after_failure: int = 0,
    ) -> int:
        return self.tasks.enqueue(
            name, {}, queue=queue, priority=priority, key=key, max_attempts=max_attempts,
            delay=delay, after=after, after_failure=after_failure,
        )  # fmt: skip

    def _make_store(
        self,
        queues: list[str],
        names: Sequence[str] | None,
        retention: Literal["delete", "keep"],
        per_key: dict[str, int],
        fair: Sequence[str] = (),
        fair_share: int = 3,
    ) -> TaskStore:
        return self.store_class(  # type: ignore[no-any-return]
            self.tasks, queues=queues, names=names, retention=retention, per_key=per_key,
            fair=fair, fair_share=fair_share,
        )  # fmt: skip

    async def row(self, task_id: int) -> TaskRow | None:
        r = self.tasks.row(task_id)
        if r is None:
            return None
        return TaskRow(
            _STATUS[int(r.status)], r.attempts, r.lapses, r.spared, r.available_at <= self.clock(),
            r.claim_token, r.last_error, r.error_type,
            None if r.result is None else json.loads(r.result),
            None if r.progress is None else json.loads(r.progress), r.keep_until is not None,
        )  # fmt: skip

    async def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)


class PostgresTaskBackend(TaskBackend):
    name = "postgres"

    def __init__(self, dsn: str) -> None:
        super().__init__()
        self.dsn = dsn
        migrate_tasks(dsn, table=TABLE)
        self.sql = TaskStatements(TABLE)

    async def enqueue(
        self,
        name: str = "job",
        *,
        queue: str = "default",
        priority: int = 0,
        key: str | None = None,
        max_attempts: int | None = None,
        delay: float = 0.0,
        after: Sequence[int] = (),
        after_failure: int = 0,
    ) -> int:
        named = {"task_name": name, "queue": queue, "payload": "{}", "priority": priority,
                 "key": key, "unique_key": None, "max_attempts": max_attempts, "run_at": None,
                 "delay": delay, "trace": None, "channel": self.sql.channel,
                 "after": sorted(set(after)),
                 "after_failure": after_failure}  # fmt: skip
        async with await psycopg.AsyncConnection.connect(self.dsn) as conn:
            if after:
                values = [named[n] for n in self.sql.enqueue_after_names]
                cur = await conn.execute(self.sql.enqueue_after, values)
            else:
                cur = await conn.execute(self.sql.enqueue, [
                    named[n] for n in ("task_name", "queue", "payload", "priority", "key",
                                       "unique_key", "max_attempts", "run_at", "delay",
                                       "trace", "channel")
                ])  # fmt: skip
            row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    def _make_store(
        self,
        queues: list[str],
        names: Sequence[str] | None,
        retention: Literal["delete", "keep"],
        per_key: dict[str, int],
        fair: Sequence[str] = (),
        fair_share: int = 3,
    ) -> TaskStore:
        return PgTaskStore(
            self.dsn, TABLE, queues=queues, names=names, retention=retention, per_key=per_key,
            fair=fair, fair_share=fair_share,
        )  # fmt: skip

    async def row(self, task_id: int) -> TaskRow | None:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cur = await conn.execute(
                f"SELECT status, attempts, lapses, spared, available_at <= now(), claim_token,"
                f" last_error, error_type, result, progress, keep_until IS NOT NULL"
                f" FROM {TABLE} WHERE id = %s",
                (task_id,),
            )
            r: Any = await cur.fetchone()
        if r is None:
            return None
        return TaskRow(_STATUS[int(r[0])], *r[1:])

    async def advance(self, seconds: float) -> None:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            await conn.execute(
                f"UPDATE {TABLE} SET available_at = available_at - make_interval(secs => %s),"
                f" keep_until = keep_until - make_interval(secs => %s)",
                (seconds, seconds),
            )
            for buckets in (f"{TABLE}_limits", f"{TABLE}_key_rates"):
                await conn.execute(  # rate limits' buckets refill by the same clock
                    f"UPDATE {buckets} SET at = at - make_interval(secs => %s)", (seconds,)
                )

    def lifecycle_store(self, tasks: Tasks) -> TaskStore | None:
        from outboxkit.backends.postgres.migrate import migrate
        from outboxkit.tasks.lifecycle import LifecycleEvents
        from outboxkit.write.outbox import Outbox

        migrate(self.dsn, table=OUTBOX)
        hook = LifecycleEvents(tasks, Outbox(table=OUTBOX))
        store = PgTaskStore(self.dsn, TABLE, on_settle=hook)
        self._stores.append(store)
        return store

    async def events(self) -> list[tuple[str, int]]:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cur = await conn.execute(f"SELECT event_type, aggregate_id FROM {OUTBOX} ORDER BY id")
            return [(t, int(i)) for t, i in await cur.fetchall()]


class MariaDBTaskBackend(TaskBackend):
    """A task table in a database of its own on the private mariadbd; tasks enqueued by
    ``Tasks.enqueue``'s MariaDB statements (tasks/enqueue_mariadb.py), through PyMySQL."""

    name = "mariadb"
    parks = False
    fair_enqueue = False

    def __init__(self, server: Any) -> None:
        import pymysql

        from outboxkit.backends.mariadb.migrate import migrate as mariadb_migrate
        from outboxkit.drivers import sync_adapter
        from outboxkit.drivers.base import Use
        from outboxkit.tasks.enqueue_mariadb import MariaDBTaskEnqueue

        super().__init__()
        self.database = f"contract_{uuid.uuid4().hex[:12]}"
        self.admin = pymysql.connect(**server.connect_args(), autocommit=True)
        with self.admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {self.database}")
        self.url = server.url_for(self.database)
        mariadb_migrate(self.url, table=TABLE, kind="tasks")
        self.conn = pymysql.connect(**server.connect_args(self.database), autocommit=False)
        self.enqueuer = MariaDBTaskEnqueue(TABLE)
        self.adapter = sync_adapter(self.conn, Use("enqueue", "enqueue", "enqueue()", "-"))

    async def enqueue(
        self,
        name: str = "job",
        *,
        queue: str = "default",
        priority: int = 0,
        key: str | None = None,
        max_attempts: int | None = None,
        delay: float = 0.0,
        after: Sequence[int] = (),
        after_failure: int = 0,
    ) -> int:
        params = [name, queue, "{}", priority, key, None, max_attempts, None, delay, None]
        task_id = self.enqueuer.enqueue(
            self.adapter, self.conn, params, sorted(set(after)), after_failure
        )
        self.conn.commit()
        assert task_id is not None
        return int(task_id)

    def lacks(self, feature: Feature) -> str | None:
        from outboxkit.backends.mariadb.backend import MariaDBBackend

        return MariaDBBackend.cannot.get(feature)

    def _make_store(
        self,
        queues: list[str],
        names: Sequence[str] | None,
        retention: Literal["delete", "keep"],
        per_key: dict[str, int],
        fair: Sequence[str] = (),
        fair_share: int = 3,
    ) -> TaskStore:
        from outboxkit.backends.mariadb.tasks import MariaDBTaskStore

        return MariaDBTaskStore(
            self.url, TABLE, queues=queues, names=names, retention=retention, per_key=per_key,
            fair=fair, fair_share=fair_share,
        )  # fmt: skip

    async def row(self, task_id: int) -> TaskRow | None:
        self.conn.commit()  # (a fresh snapshot)
        with self.conn.cursor() as cur:
            cur.execute(
                "SELECT status, attempts, lapses, spared, available_at <= UTC_TIMESTAMP(6),"
                " claim_token, last_error, error_type, result, progress, keep_until IS NOT NULL"
                f" FROM {TABLE} WHERE id = %s",
                (task_id,),
            )
            r = cur.fetchone()
        if r is None:
            return None
        token = None if r[5] is None else uuid.UUID(r[5])
        result = None if r[8] is None else json.loads(r[8])
        progress = None if r[9] is None else json.loads(r[9])
        return TaskRow(
            _STATUS[int(r[0])], r[1], r[2], r[3], bool(r[4]), token, r[6], r[7], result,
            progress, bool(r[10]),
        )  # fmt: skip

    async def advance(self, seconds: float) -> None:
        shift = "INTERVAL %s MICROSECOND"
        micros = round(seconds * 1e6)
        with self.conn.cursor() as cur:
            cur.execute(
                f"UPDATE {TABLE} SET available_at = available_at - {shift},"
                f" keep_until = keep_until - {shift}",
                (micros, micros),
            )
            for buckets in (f"{TABLE}_limits", f"{TABLE}_key_rates"):
                cur.execute(f"UPDATE {buckets} SET at = at - {shift}", (micros,))
        self.conn.commit()

    def lifecycle_store(self, tasks: Tasks) -> TaskStore | None:
        from outboxkit.backends.mariadb.backend import MARIADB
        from outboxkit.backends.mariadb.migrate import migrate as mariadb_migrate
        from outboxkit.backends.mariadb.tasks import MariaDBTaskStore
        from outboxkit.tasks.lifecycle import LifecycleEvents
        from outboxkit.write.outbox import Outbox

        mariadb_migrate(self.url, table=OUTBOX, kind="outbox")
        hook = LifecycleEvents(tasks, Outbox(table=OUTBOX), MARIADB)
        store = MariaDBTaskStore(self.url, TABLE, on_settle=hook)
        self._stores.append(store)
        return store

    async def events(self) -> list[tuple[str, int]]:
        self.conn.commit()  # (a fresh snapshot)
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT event_type, aggregate_id FROM {OUTBOX} ORDER BY id")
            return [(t, int(i)) for t, i in cur.fetchall()]

    async def close(self) -> None:
        await super().close()
        self.conn.close()
        with self.admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {self.database}")
        self.admin.close()
