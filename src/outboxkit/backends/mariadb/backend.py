"""MariaDB/MySQL's :class:`~outboxkit.backends.ports.Backend`: the outbox (ordered or not),
the inbox, task mode and their admin; what it cannot do yet is said here, once, for every
entry point.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from outboxkit.backends.ports import (
    TASK_OPS,
    Admin,
    Backend,
    Feature,
    GaugeReader,
    InboxSql,
    Migrated,
    MigrationKind,
    ScratchDatabases,
    Statement,
    TaskAdmin,
)
from outboxkit.queue.fleet_leases import DatabaseLease
from outboxkit.queue.partition_leases import PartitionLeases
from outboxkit.queue.store import QueueStore
from outboxkit.queue.tasks import Retention, Schedules, SettleHook, TaskStore

#: Why the WAL side refuses a mysql:// URL.
NO_WAL = (
    "the WAL relay (outboxkit cdc, relay --source cdc, Outbox(storage='wal')) streams"
    " PostgreSQL's logical replication, which MariaDB/MySQL has not: relay a mysql:// outbox"
    " with the polling relay (outboxkit relay --dsn mysql://…)"
)
_OTHERS = ("blocked_keys", "stray_rows", "purge_inbox", "count_inbox_purgeable", "connect")
_ADMIN_FUNCTIONS = (
    "status", "list_failed", "get_event", "list_events", "replay", "discard", "purge",
    "count_purgeable", "live_status", "last_event_id", *_OTHERS, "usable",
)  # fmt: skip


class MariaDBBackend(Backend):
    name = "mariadb"
    label = "MariaDB/MySQL"
    cannot: dict[Feature, str] = {
        "cdc": NO_WAL,
        "pooler": "on MariaDB/MySQL the relay polls the outbox table only: the WAL source,"
        " pooler= and direct_dsn= need PostgreSQL",
        "partition_by": "on MariaDB/MySQL, migrate creates the outbox (--ordered too), the"
        " inbox and the task table: --partition-by needs PostgreSQL",
        "notify": "Outbox(notify=True) on a MariaDB/MySQL connection: MariaDB/MySQL has no"
        " LISTEN/NOTIFY (its relay polls, and a relay of this process is woken by the write):"
        " leave notify unset, or False",
    }

    def gauge_reader(self, dsn: str, table: str) -> GaugeReader:
        from outboxkit.backends.mariadb.gauges import MariaDBGaugeReader

        return MariaDBGaugeReader(dsn, table, no_slot=self.cannot["cdc"])

    def inbox_sql(self, table: str) -> InboxSql:
        from outboxkit.backends.mariadb.inbox_sql import InboxStatements, check_consumer

        sq = InboxStatements(table)
        return InboxSql(sq.mark, sq.mark, sq.is_processed, sq.is_processed,
                        check_consumer=check_consumer)  # fmt: skip

    @contextlib.asynccontextmanager
    async def atransaction(self, dsn: str) -> AsyncIterator[Any]:
        from outboxkit.backends.mariadb.session import atransaction

        async with atransaction(dsn) as conn:
            yield conn

    def scratch_databases(self) -> ScratchDatabases:
        from outboxkit.backends.mariadb import databases

        return databases

    def fleet_lease(self, dsn: str, service: str, member: str, ttl: float) -> DatabaseLease:
        from outboxkit.backends.mariadb.fleet_leases import MariaDBFleetLease

        return MariaDBFleetLease(dsn, service, member, ttl)

    def migrate_fleet(self, dsn: str) -> bool:
        from outboxkit.backends.mariadb.fleet_leases import create_table

        return create_table(dsn)

    def fleet_ddl(self) -> str:
        from outboxkit.backends.mariadb import migrate as mariadb
        from outboxkit.backends.mariadb.fleet_sql import TABLE

        return mariadb.ddl("fleet", TABLE)

    def fleet_owner(self, dsn: str, service: str) -> str | None:
        from outboxkit.backends.mariadb.fleet_leases import lease_owner

        held = lease_owner(dsn, service)
        return held[0] if held is not None and held[1] > 0 else None

    def admin(self) -> Admin:
        from outboxkit.backends.mariadb import admin

        return Admin(
            name=self.name,
            **{name: getattr(admin, name) for name in _ADMIN_FUNCTIONS},
            connection_lost=admin.connection_lost(),
        )

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
        from outboxkit.backends.mariadb.queue import MariaDBQueueStore

        if pooler or direct_dsn:
            self.refuse("pooler")
        return MariaDBQueueStore(dsn, table, item, retention=retention, ordered=ordered)

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
        from outboxkit.backends.mariadb.partition_leases import MariaDBLeaseTable

        if pooler or direct_dsn:
            self.refuse("pooler")
        return PartitionLeases(MariaDBLeaseTable(dsn, table, relay_id, lease), relay_id, lease)

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
        from outboxkit.backends.mariadb.tasks import MariaDBTaskStore

        if pooler or direct_dsn:
            self.refuse("pooler")
        return MariaDBTaskStore(
            dsn, table, queues=queues, retention=retention, names=names, per_key=per_key,
            fair=fair or (), on_settle=on_settle,
        )  # fmt: skip

    def schedules(self, dsn: str, table: str, *, pooler: Any) -> Schedules:
        from outboxkit.backends.mariadb.schedules import MariaDBSchedules

        if pooler:
            self.refuse("pooler")
        return MariaDBSchedules(dsn, table)

    def task_admin(self) -> TaskAdmin:
        from outboxkit.backends.mariadb import task_admin, task_ops

        return TaskAdmin(
            read_result=task_admin.read_result,
            wait_result=task_admin.wait_result,
            await_result=task_admin.await_result,
            pause_queue=task_admin.pause_queue,
            resume_queue=task_admin.resume_queue,
            **{name: getattr(task_ops, name) for name in TASK_OPS},
        )

    def tool_migration(
        self, kind: MigrationKind, table: str, version: int
    ) -> tuple[list[Statement], list[Statement]]:
        from outboxkit.backends.mariadb import tool_migrations

        return tool_migrations.statements(kind, table, version)

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
        from outboxkit.backends.mariadb import migrate as mariadb

        self._refuse_kind(kind, partition_by)
        options: dict[str, Any] = {"repartition": True} if repartition else {}
        if partitions is not None:
            options["partitions"] = partitions
        return mariadb.migrate(dsn, table=table, kind=kind, **options)

    def ddl(
        self,
        kind: MigrationKind,
        table: str,
        *,
        partition_by: str | None = None,
        partitions: int | None = None,
        repartition: bool = False,
    ) -> str:
        from outboxkit.backends.mariadb import migrate as mariadb
        from outboxkit.backends.mariadb.sql import DEFAULT_PARTITIONS

        self._refuse_kind(kind, partition_by)
        count = DEFAULT_PARTITIONS if partitions is None else partitions
        return mariadb.ddl(kind, table, count, repartition=repartition)

    def _refuse_kind(self, kind: MigrationKind, partition_by: str | None) -> None:
        if partition_by is not None:
            self.refuse("partition_by")


#: The one instance (stateless).
MARIADB = MariaDBBackend()
