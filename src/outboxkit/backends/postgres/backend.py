"""PostgreSQL's :class:`~outboxkit.backends.ports.Backend`: every port, and nothing refused.

Each port is imported when asked for, so choosing the backend costs no import of what a
process does not use (the relay never loads the task store, the CLI's admin commands never
load the claim loop's).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from outboxkit.backends.ports import (
    TASK_OPS,
    Admin,
    Backend,
    GaugeReader,
    InboxSql,
    Migrated,
    MigrationKind,
    ScratchDatabases,
    Statement,
    TaskAdmin,
)
from outboxkit.errors import ConfigurationError
from outboxkit.maintenance.side_task import PartitionChore
from outboxkit.queue.fleet_leases import DatabaseLease
from outboxkit.queue.partition_leases import PartitionLeases
from outboxkit.queue.store import QueueStore
from outboxkit.queue.tasks import Retention, Schedules, SettleHook, TaskStore

_ADMIN_FUNCTIONS = (
    "status", "list_failed", "get_event", "list_events", "replay", "discard", "purge",
    "count_purgeable", "live_status", "last_event_id",
)  # fmt: skip


class PostgresBackend(Backend):
    name = "postgresql"
    label = "PostgreSQL"

    def check_dsn(self, dsn: str, *, name: str = "the relay's dsn") -> None:
        from outboxkit.backends.postgres._connection import check_dsn, split_pooler

        check_dsn(split_pooler(dsn)[0], name=name)  # (?pooler= is outboxkit's, not libpq's)

    def refusal(self, exc: BaseException) -> ConfigurationError | None:
        from outboxkit.backends.postgres._connection import refusal

        return refusal(exc)

    def partition_chore(self, dsn: str, table: str) -> PartitionChore:
        from outboxkit.backends.postgres.partitions import PartitionChore as Chore

        return Chore(dsn, table)

    async def reach(self, dsn: str, *, application_name: str) -> None:
        from outboxkit.backends.postgres._connection import aconnect

        conn = await aconnect(dsn, application_name=application_name)
        await conn.close()

    def gauge_reader(self, dsn: str, table: str) -> GaugeReader:
        from outboxkit.backends.postgres.gauges import PgGaugeReader

        return PgGaugeReader(dsn, table)

    def inbox_sql(self, table: str) -> InboxSql:
        from outboxkit.backends.postgres.inbox_sql import InboxStatements
        from outboxkit.backends.postgres.postgres import numbered

        sq = InboxStatements(table)
        return InboxSql(sq.mark, numbered(sq.mark), sq.is_processed, numbered(sq.is_processed))

    @contextlib.asynccontextmanager
    async def atransaction(self, dsn: str) -> AsyncIterator[Any]:
        from outboxkit.backends.postgres._connection import aconnect

        conn = await aconnect(dsn, application_name="outboxkit-testing", autocommit=False)
        async with conn, conn.transaction():
            yield conn

    def scratch_databases(self) -> ScratchDatabases:
        from outboxkit.backends.postgres import databases

        return databases

    def fleet_lease(self, dsn: str, service: str, member: str, ttl: float) -> DatabaseLease:
        from outboxkit.backends.postgres.fleet_sql import PgFleetLease

        return PgFleetLease(dsn, service, member, ttl)

    def migrate_fleet(self, dsn: str) -> bool:
        from outboxkit.backends.postgres._connection import connect
        from outboxkit.backends.postgres.fleet_sql import create_table
        from outboxkit.backends.postgres.migrate import APPLICATION_NAME

        with connect(dsn, application_name=APPLICATION_NAME, autocommit=True) as conn:
            return create_table(conn)

    def fleet_ddl(self) -> str:
        from outboxkit.backends.postgres.fleet_sql import CREATE

        return "".join(f"{statement};\n" for statement in CREATE)

    def fleet_owner(self, dsn: str, service: str) -> str | None:
        from outboxkit.backends.postgres._connection import connect
        from outboxkit.backends.postgres.fleet_sql import LEASE_APPLICATION_NAME, lease_owner

        with connect(dsn, application_name=LEASE_APPLICATION_NAME) as conn:
            held = lease_owner(conn, service)
        return held[0] if held is not None and held[1] > 0 else None

    def admin(self) -> Admin:
        import psycopg

        from outboxkit.backends.postgres import admin, inbox_sql
        from outboxkit.backends.postgres._connection import connect
        from outboxkit.backends.postgres.ordered_sql import blocked_keys
        from outboxkit.backends.postgres.partitions import stray_rows

        def connect_dashboard(dsn: str) -> Any:
            return connect(dsn, application_name="outboxkit-dashboard")

        def usable(conn: Any) -> bool:
            return not (conn.closed or conn.broken)

        return Admin(
            name=self.name,
            **{name: getattr(admin, name) for name in _ADMIN_FUNCTIONS},
            blocked_keys=blocked_keys,
            stray_rows=stray_rows,
            purge_inbox=inbox_sql.purge_inbox,
            count_inbox_purgeable=inbox_sql.count_inbox_purgeable,
            connect=connect_dashboard,
            usable=usable,
            connection_lost=(psycopg.OperationalError,),
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
        from outboxkit.backends.postgres.queue_pg import PgQueueStore

        return PgQueueStore(
            dsn, table, item, retention=retention, ordered=ordered,
            synchronous_commit=synchronous_commit, pooler=pooler, direct_dsn=direct_dsn,
        )  # fmt: skip

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
        from outboxkit.backends.postgres.partition_leases import PgLeaseTable

        statements = PgLeaseTable(
            dsn, table, relay_id, lease, pooler=pooler, direct_dsn=direct_dsn,
            unique_id=unique_id,
        )  # fmt: skip
        return PartitionLeases(statements, relay_id, lease)

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
        from outboxkit.backends.postgres.tasks_pg import PgTaskStore

        return PgTaskStore(
            dsn, table, queues=queues, retention=retention, on_settle=on_settle,
            pooler=pooler, direct_dsn=direct_dsn, names=names, per_key=per_key,
            fair=fair or (),
        )  # fmt: skip

    def schedules(self, dsn: str, table: str, *, pooler: Any) -> Schedules:
        from outboxkit.backends.postgres.tasks_pg import PgSchedules

        return PgSchedules(dsn, table, pooler=pooler)

    def task_admin(self) -> TaskAdmin:
        from outboxkit.backends.postgres import tasks_pg

        return TaskAdmin(
            read_result=tasks_pg.read_result,
            wait_result=tasks_pg.wait_result,
            await_result=tasks_pg.await_result,
            pause_queue=tasks_pg.pause_queue,
            resume_queue=tasks_pg.resume_queue,
            **{name: getattr(tasks_pg, name) for name in TASK_OPS},
        )

    def tool_migration(
        self, kind: MigrationKind, table: str, version: int
    ) -> tuple[list[Statement], list[Statement]]:
        from outboxkit.backends.postgres.tool_migrations import (
            downgrade_statements,
            upgrade_statements,
        )

        return (
            list(upgrade_statements(table, kind=kind, version=version)),
            list(downgrade_statements(table, kind=kind, version=version)),
        )

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
        from outboxkit.backends.postgres import migrate as pg

        if kind == "inbox":
            return pg.migrate_inbox(dsn, table=table)
        if kind == "tasks":
            return pg.migrate_tasks(dsn, table=table)
        options: dict[str, Any] = {} if partition_by is None else {"partition_by": partition_by}
        if kind == "ordered":
            options |= {"ordered": True, "repartition": repartition}
            if partitions is not None:
                options["partitions"] = partitions
        return pg.migrate(dsn, table=table, **options)

    def ddl(
        self,
        kind: MigrationKind,
        table: str,
        *,
        partition_by: str | None = None,
        partitions: int | None = None,
        repartition: bool = False,
    ) -> str:
        if kind == "inbox":
            from outboxkit.backends.postgres.inbox_sql import InboxStatements

            return InboxStatements(table).ddl()
        if kind == "tasks":
            from outboxkit.backends.postgres.tasks_sql import TaskStatements

            return TaskStatements(table).ddl()
        if kind == "ordered":
            from outboxkit.backends.postgres.ordered_sql import (
                DEFAULT_PARTITIONS,
                OrderedStatements,
            )

            stmts = OrderedStatements(table)
            script = stmts.ddl() + (stmts.repartition_ddl() if repartition else "")
            return script + stmts.ordered_ddl(partitions or DEFAULT_PARTITIONS)
        if partition_by is not None:
            from outboxkit.backends.postgres.partitions import partitioned_script

            return partitioned_script(table, partition_by)
        from outboxkit.backends.postgres.postgres import Statements

        return Statements(table).ddl()


#: The one instance (stateless).
POSTGRES = PostgresBackend()
