"""What one database backend hands out: the :class:`Backend` every layer above asks, once.

A backend (``backends/postgres/``, ``backends/mariadb/``) subclasses :class:`Backend`; the
chooser in ``backends/__init__.py`` picks one from a URL or a connection. Nothing outside
``backends/`` asks which database it is: it asks the backend for a port (the queue store,
the task store, the admin functions, the migrator) or whether it can do something
(:meth:`Backend.refuse`, one line naming what is missing, said in one place).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from outboxkit.errors import ConfigurationError
from outboxkit.maintenance.report import LiveStatus, OutboxStatus
from outboxkit.maintenance.side_task import PartitionChore
from outboxkit.queue.fleet_leases import DatabaseLease
from outboxkit.queue.partition_leases import PartitionLeases
from outboxkit.queue.store import QueueStore
from outboxkit.queue.tasks import Retention, Schedules, SettleHook, TaskStore

__all__ = [
    "POOLER_MODES", "Admin", "Backend", "Feature", "GaugeReader", "GaugeRows", "Migrated",
    "MigrationKind", "PoolerMode", "ScratchDatabases", "SlotReading", "Statement", "TaskAdmin",
    "pooler_mode",
]  # fmt: skip

#: What a backend may not do: task mode, the WAL relay, a transaction pooler's settings,
#: time partitions of the outbox table, a NOTIFY sent by the write, the Alembic helper's
#: versioned SQL, task lifecycle events written by the settle (``events=``), limits per key,
#: the lease by which fleet processes divide their databases (``fleet_leases``).
Feature = Literal[
    "tasks",
    "cdc",
    "pooler",
    "partition_by",
    "notify",
    "alembic",
    "task_events",
    "task_key_limits",
    "fleet_leases",
]
#: A statement a host tool runs: SQL alone, or SQL and its parameters.
Statement = str | tuple[str, tuple[Any, ...]]
#: The tables ``outboxkit migrate`` creates.
MigrationKind = Literal["outbox", "ordered", "inbox", "tasks"]

#: What may sit between outboxkit and the database (``?pooler=`` in a DSN, ``--pooler``,
#: ``Relay(pooler=)``, ``Worker(pooler=)``): configuration, so here and not in one backend
#: (PostgreSQL's reads it; MariaDB's refuses any but None through ``cannot["pooler"]``).
#: ``auto`` finds out; ``none`` (PostgreSQL itself) and ``session`` (a session pooler) keep
#: everything; ``transaction``: a transaction pooler that keeps no prepared statements
#: (PgBouncer before 1.21, or ``max_prepared_statements = 0``); ``transaction-prepared``:
#: one that keeps them (PgBouncer 1.21+ with ``max_prepared_statements`` set).
PoolerMode = Literal["auto", "none", "session", "transaction", "transaction-prepared"]
POOLER_MODES: tuple[PoolerMode, ...] = (
    "auto",
    "none",
    "session",
    "transaction",
    "transaction-prepared",
)


def pooler_mode(mode: str) -> PoolerMode:
    """``mode`` as a :data:`PoolerMode`, or ConfigurationError naming the known ones."""
    for known in POOLER_MODES:
        if mode == known:
            return known
    raise ConfigurationError(
        f"pooler={mode!r} is not a pooler mode: use one of {', '.join(POOLER_MODES)}"
        " (README, 'Behind PgBouncer')"
    )


@dataclass(frozen=True, slots=True)
class Admin:
    """One backend's operator functions (each takes a URL or an open connection first)."""

    #: "postgresql" or "mariadb", for messages.
    name: str
    status: Callable[..., OutboxStatus]
    list_failed: Callable[..., list[dict[str, Any]]]
    get_event: Callable[..., dict[str, Any] | None]
    #: Every event with every column, in write order (the testing kit's ``outbox_events``).
    list_events: Callable[..., list[dict[str, Any]]]
    replay: Callable[..., int]
    discard: Callable[..., int]
    purge: Callable[..., int]
    count_purgeable: Callable[..., int]
    live_status: Callable[..., LiveStatus]
    last_event_id: Callable[..., int]
    blocked_keys: Callable[..., list[dict[str, Any]]]
    stray_rows: Callable[..., int]
    purge_inbox: Callable[..., int]
    count_inbox_purgeable: Callable[..., int]
    #: A connection to keep (the dashboard's), whether a kept one still works, and the
    #: errors that mean it died.
    connect: Callable[[str], Any]
    usable: Callable[[Any], bool]
    connection_lost: tuple[type[BaseException], ...]


@dataclass(frozen=True, slots=True)
class TaskAdmin:
    """One backend's task-mode reads and switches, as ``Tasks`` and the task commands ask
    them (each takes a URL or an open connection, then the task table): results, waits,
    pausing a queue, listing, replaying, cancelling and purging tasks."""

    #: One task's state, value, error, progress and timings (a row), or None.
    read_result: Callable[..., dict[str, Any] | None]
    #: Block until the task is finished; its row (``timeout`` seconds at most).
    wait_result: Callable[..., dict[str, Any]]
    #: The asyncio twin of ``wait_result`` (a coroutine function).
    await_result: Callable[..., Any]
    pause_queue: Callable[..., bool]
    resume_queue: Callable[..., bool]
    # -- `outboxkit tasks …` and the worker's task gauges: rows of the same keys and types
    #: Tasks by id, of a state, name, queue, due-ness (``status=``, ``name=``...).
    list_tasks: Callable[..., list[dict[str, Any]]]
    #: Every column of one task, its payload as ``payload_json`` text and its edges, or None.
    show_task: Callable[..., dict[str, Any] | None]
    #: Failed or cancelled tasks run again: (ids replayed, [(id, unique_key) left failed]).
    replay_tasks_reporting: Callable[..., tuple[list[int], list[tuple[int, str]]]]
    cancel_tasks: Callable[..., list[int]]
    discard_tasks: Callable[..., list[int]]
    #: Each queue with live tasks or a pause record: paused, since, by, queued, running.
    queue_states: Callable[..., list[dict[str, Any]]]
    #: Finished tasks older than ``older_than`` seconds deleted in batches; how many.
    purge_finished: Callable[..., int]
    #: Per task name: queued, scheduled, running, failed, oldest queued age (s) or None.
    task_gauges: Callable[..., list[tuple[Any, ...]]]


#: The task commands' functions of :class:`TaskAdmin`, named alike in each backend's module.
TASK_OPS = (
    "list_tasks", "show_task", "replay_tasks_reporting", "cancel_tasks", "discard_tasks",
    "queue_states", "purge_finished", "task_gauges",
)  # fmt: skip


class ScratchDatabases(Protocol):
    """A backend's ``databases`` module: a test's scratch database made and dropped."""

    def create_database(
        self, admin_dsn: str, name: str, *, template: str | None = ..., connect_timeout: int = ...
    ) -> None:
        """A new, empty database ``name`` on ``admin_dsn``'s server (a copy of ``template``
        where the database has templates)."""

    def drop_database(self, admin_dsn: str, name: str, *, connect_timeout: int = ...) -> None:
        """Drop ``name`` if it exists, disconnecting whoever is still connected."""


class Migrated(Protocol):
    """A migration's result, as ``outboxkit migrate`` reports it."""

    def describe(self) -> str: ...


@dataclass(frozen=True, slots=True)
class GaugeRows:
    """One reading of the outbox table's gauges, at most ``cap`` rows each: (topic, pending,
    in flight, oldest pending age in seconds or None) and (topic, failed) rows."""

    pending: Sequence[tuple[Any, ...]]
    failed: Sequence[tuple[Any, ...]]


@dataclass(frozen=True, slots=True)
class SlotReading:
    """A replication slot as the server reports it: WAL written since its confirmed position
    (None when unknown) and its ``wal_status`` (``missing`` when there is no such slot)."""

    lag_bytes: int | None
    wal_status: str | None


class GaugeReader(abc.ABC):
    """The metrics' kept connection to one outbox table (``ops/metrics.py``'s gauge task):
    opened at the first reading, closed and opened again after one fails with :attr:`errors`."""

    #: What a failed reading raises (the gauge task records it and reads again later).
    errors: tuple[type[BaseException], ...] = ()

    @abc.abstractmethod
    async def read(self, cap: int) -> GaugeRows:
        """The table's gauges (two bounded statements)."""

    async def slot(self, slot: str) -> SlotReading:
        """The WAL relay's replication ``slot``, on the same connection as :meth:`read`; a
        backend without the WAL relay refuses through :attr:`Backend.cannot`."""
        raise NotImplementedError

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the kept connection, whatever its state (the next reading opens one)."""


@dataclass(frozen=True, slots=True)
class InboxSql:
    """One inbox table's two statements on a database, each in the driver adapters' two
    parameter styles (``%s`` and ``$n``; the same text where the database has one), and the
    check of a consumer name before them (``outboxkit.inbox.Inbox``)."""

    mark: str
    mark_dollar: str
    is_processed: str
    is_processed_dollar: str
    #: Raises ValueError for a consumer name the table cannot keep as given.
    check_consumer: Callable[[str], None] = lambda _consumer: None


class Backend(abc.ABC):
    """One database kind's ports. Stateless: one instance per kind, shared."""

    #: "postgresql" or "mariadb" (metrics, messages).
    name: str
    #: How a person names it: "PostgreSQL", "MariaDB/MySQL".
    label: str
    #: What this database cannot do, each with the one line that says so and what to do.
    cannot: Mapping[Feature, str] = {}

    def __repr__(self) -> str:
        return f"<{self.label} backend>"

    def can(self, feature: Feature) -> bool:
        return feature not in self.cannot

    def refuse(self, feature: Feature) -> None:
        """ConfigurationError naming what is missing, if this database cannot do ``feature``."""
        reason = self.cannot.get(feature)
        if reason is not None:
            raise ConfigurationError(reason)

    def check_dsn(self, dsn: str, *, name: str = "the relay's dsn") -> None:
        """A DSN this backend's driver cannot parse fails here, not at the first connection
        (ConfigurationError, one line naming it ``name``, no secret quoted)."""
        return None

    async def reach(self, dsn: str, *, application_name: str) -> None:
        """Connect once and hang up: the driver's error if the database cannot be reached or
        refuses the login (a fleet tries a database so before it relays it)."""
        conn = await asyncio.to_thread(self.admin().connect, dsn)
        await asyncio.to_thread(conn.close)

    def refusal(self, exc: BaseException) -> ConfigurationError | None:
        """The one-line error when ``exc`` (a store error's cause at the relay's start) means
        the database refuses the relay for good (a missing database or role, a bad
        password), or None: an outage, which the claim loop retries."""
        return None

    def partition_chore(self, dsn: str, table: str) -> PartitionChore | None:
        """The relay's time-partition maintenance of ``table`` (a side task that returns at
        once on a plain table), or None where the database has no time partitions."""
        return None

    @abc.abstractmethod
    def gauge_reader(self, dsn: str, table: str) -> GaugeReader:
        """The metrics' reader of ``table``'s gauges (and the WAL relay's slot)."""

    @abc.abstractmethod
    def inbox_sql(self, table: str) -> InboxSql:
        """The inbox table's statements on this database (``table`` checked and quoted)."""

    @abc.abstractmethod
    def atransaction(self, dsn: str) -> AbstractAsyncContextManager[Any]:
        """A new async connection of this database's driver (psycopg's, aiomysql's) inside a
        transaction: committed when the block ends, rolled back on an exception, then
        closed. What a consumer's handler writes through (the testing kit's inbox)."""

    @abc.abstractmethod
    def scratch_databases(self) -> ScratchDatabases:
        """Making and dropping a test's scratch database (``outboxkit.testing``)."""

    @abc.abstractmethod
    def admin(self) -> Admin:
        """The operator functions (built at each call: a test that replaces one is heard)."""

    @abc.abstractmethod
    def queue_store(
        self,
        dsn: str,
        table: str,
        item: Callable[..., Any],
        *,
        retention: Retention,
        ordered: bool,
        synchronous_commit: bool = False,
        pooler: Any = None,
        direct_dsn: str | None = None,
    ) -> QueueStore[Any]:
        """The outbox table as the claim loop's store (``item`` builds a claimed row)."""

    @abc.abstractmethod
    def partition_leases(
        self,
        dsn: str,
        table: str,
        relay_id: str,
        lease: float,
        *,
        pooler: Any = None,
        direct_dsn: str | None = None,
        unique_id: bool = False,
    ) -> PartitionLeases:
        """Ordered mode's partition leases of one relay (the core's algorithm over this
        database's lease-table statements)."""

    def fleet_lease(self, dsn: str, service: str, member: str, ttl: float) -> DatabaseLease:
        """Fleet process ``member``'s lease on this database's ``service`` (fleet/leases.py);
        a backend without one refuses through :attr:`cannot`."""
        self.refuse("fleet_leases")
        raise ConfigurationError(f"{self.label} keeps no fleet lease")

    def migrate_fleet(self, dsn: str) -> bool:
        """Create this database's fleet lease table if missing (``migrate --fleet``); True if
        it was created. A backend without a fleet lease refuses through :attr:`cannot`."""
        self.refuse("fleet_leases")
        raise ConfigurationError(f"{self.label} keeps no fleet lease")

    def fleet_ddl(self) -> str:
        """The fleet lease table's DDL (``migrate --fleet --print-sql``)."""
        self.refuse("fleet_leases")
        raise ConfigurationError(f"{self.label} keeps no fleet lease")

    def fleet_owner(self, dsn: str, service: str) -> str | None:
        """The fleet process serving ``service`` on this database (``status --dsn-file``):
        None when none holds its lease, or this backend keeps none."""
        return None

    def task_store(
        self,
        dsn: str,
        table: str,
        *,
        queues: list[str],
        retention: Retention,
        on_settle: SettleHook | None,
        pooler: Any,
        direct_dsn: str | None,
        names: list[str] | None,
        per_key: dict[str, int] | None = None,
        fair: list[str] | None = None,
    ) -> TaskStore:
        """The task table as task mode's store (queue/tasks.py); a backend without one
        refuses through :attr:`cannot`. ``per_key``: task name -> its ``concurrency_per_key``
        (the promotions of its keys' waiting tasks); ``fair``: the names with ``fair=True``."""
        self.refuse("tasks")
        raise ConfigurationError(f"{self.label} has no task store")

    def schedules(self, dsn: str, table: str, *, pooler: Any) -> Schedules:
        """The periodic tasks' slots (tasks/periodic.py's store)."""
        self.refuse("tasks")
        raise ConfigurationError(f"{self.label} has no task store")

    def task_admin(self) -> TaskAdmin:
        """Task mode's reads and switches (``Tasks.result``, ``wait``, ``pause``...)."""
        self.refuse("tasks")
        raise ConfigurationError(f"{self.label} has no task store")

    def tool_migration(
        self, kind: MigrationKind, table: str, version: int
    ) -> tuple[list[Statement], list[Statement]]:
        """The statements a host tool's migration (Django's ``outboxkit`` app) runs for schema
        version ``version`` of ``kind`` in PostgreSQL's numbering, which those migrations
        follow, and their reverse: ``outboxkit migrate``'s files, recorded as it records
        them, so either tool finds the other's work done."""
        self.refuse("alembic")
        raise ConfigurationError(f"{self.label} has no versioned SQL for other tools")

    @abc.abstractmethod
    def migrate(
        self,
        dsn: str,
        kind: MigrationKind,
        table: str,
        *,
        partition_by: str | None = None,
        partitions: int | None = None,
        repartition: bool = False,
    ) -> Migrated:
        """Create or upgrade one table (``outboxkit migrate``)."""

    @abc.abstractmethod
    def ddl(
        self,
        kind: MigrationKind,
        table: str,
        *,
        partition_by: str | None = None,
        partitions: int | None = None,
        repartition: bool = False,
    ) -> str:
        """The DDL ``migrate`` would run on an empty database (``--print-sql``)."""
