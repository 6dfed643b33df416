"""``outboxkit migrate`` on MariaDB/MySQL: apply the kind's versioned files not yet recorded."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any

from outboxkit.backends.mariadb import sql
from outboxkit.backends.mariadb.ordered_sql import OrderedStatements
from outboxkit.errors import (
    ConfigurationError,
    SchemaError,
    StoreError,
    StoreUnavailable,
    repartition_refused,
    repartition_while_running,
)

#: Seconds the repartition's table rewrite may wait for the table's metadata lock.
REPARTITION_LOCK_WAIT_S = 10


@dataclass(frozen=True, slots=True)
class MigrationResult:
    """What a migrate run did, for its one-line report."""

    kind: str
    table: str
    applied: list[int]
    version: int
    #: Ordered mode's partition count, and the one it had if this run changed it.
    partitions: int | None = None
    repartitioned_from: int | None = None

    def describe(self) -> str:
        if not self.applied:
            line = f"{self.kind} table {self.table!r} is up to date (schema version {self.version})"
        else:
            line = (
                f"{self.kind} table {self.table!r} migrated to schema version {self.version}"
                f" (applied {', '.join(str(v) for v in self.applied)}) on MariaDB"
            )
        if self.repartitioned_from is not None:
            return f"{line}; repartitioned from {self.repartitioned_from} to {self.partitions}"
        return line if self.partitions is None else f"{line}; {self.partitions} partitions"


def connect(dsn: str, **options: Any) -> Any:
    """A PyMySQL connection to ``dsn``; StoreUnavailable (with the server's reason) if none."""
    try:
        import pymysql
    except ImportError:  # pragma: no cover - the extra is missing
        raise ConfigurationError(
            "MariaDB/MySQL needs PyMySQL: pip install 'outboxkit[mysql]'"
        ) from None
    try:
        return pymysql.connect(**sql.connect_args(dsn), **options)
    except pymysql.err.OperationalError as exc:
        raise StoreUnavailable(
            f"cannot reach MariaDB: {exc.args[-1]} — check --dsn and that the server is up",
            cause=exc,
        ) from None


def migrate(
    dsn: str,
    *,
    table: str = "outbox",
    kind: sql.Kind = "outbox",
    partitions: int | None = None,
    repartition: bool = False,
) -> MigrationResult:
    """Create or upgrade ``table`` (idempotent; concurrent runs wait on a named lock).

    ``kind="ordered"`` adds ordered mode to the outbox ``table`` (created first if need be)
    with ``partitions`` key partitions (default 64, or the table's current count).
    Changing the count of an ordered table needs ``repartition=True`` with every relay
    stopped, as on PostgreSQL.
    """
    import pymysql

    if (partitions is not None or repartition) and kind != "ordered":
        raise ConfigurationError("partitions and repartition apply to ordered mode only")
    if kind == "ordered":
        migrate(dsn, table=table)
    files = sql.migrations(kind)
    conn = connect(dsn, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.MIGRATE_LOCK)
            try:
                current = _column_partitions(cur, table) if kind == "ordered" else None
                wanted = partitions or current or sql.DEFAULT_PARTITIONS
                cur.execute(sql.CREATE_VERSIONS)
                cur.execute(sql.APPLIED_VERSIONS, (kind, table))
                done = {int(r[0]) for r in cur.fetchall()}
                slots = sql.slots(kind, table, wanted)
                applied = []
                for migration in files:
                    if migration.version in done:
                        continue
                    # DDL commits implicitly on MariaDB: each statement is idempotent.
                    for statement in migration.statements(slots):
                        cur.execute(statement)
                    cur.execute(sql.RECORD_VERSION, (kind, table, migration.version))
                    applied.append(migration.version)
                if current is not None and current != wanted:
                    _repartition(cur, table, current, wanted, repartition)
            finally:
                # A connection the statement broke (a read timeout) cannot unlock; the server
                # releases the lock with the session, and the error to report is the first.
                with contextlib.suppress(pymysql.err.MySQLError):
                    cur.execute(sql.MIGRATE_UNLOCK)
    except pymysql.err.MySQLError as exc:
        raise StoreError(
            f"migrating the {kind} table {table!r} on MariaDB failed: {exc.args[-1]}", cause=exc
        ) from None
    finally:
        conn.close()
    ordered = kind == "ordered"
    return MigrationResult(
        kind,
        table,
        applied,
        files[-1].version,
        wanted if ordered else None,
        current if ordered and current != wanted else None,
    )


def _column_partitions(cur: Any, table: str) -> int | None:
    """P as the partition column computes it, or None without the column."""
    *database, bare = table.split(".")
    cur.execute(
        OrderedStatements(table).partition_expression, (database[0] if database else None, bare)
    )
    row = cur.fetchone()
    if row is None:
        return None
    found = re.search(r"(\d+)\s*\)?\s*$", str(row[0]))
    if not found:
        raise SchemaError(
            f"the partition column of {table!r} is not the one `migrate --ordered` creates"
            f" ({row[0]}): drop it and migrate again"
        )
    return int(found.group(1))


def _repartition(cur: Any, table: str, current: int, wanted: int, repartition: bool) -> None:
    """Change P: refused without ``repartition`` and while a relay is alive (as PostgreSQL).

    Keys move between partitions, so no relay may hold a lease meanwhile. Rows in flight
    keep their claim (their lease still blocks their key until it ends); the partition
    leases start over unowned, which fences out any settle of a relay from before.
    """
    o = OrderedStatements(table)
    if not repartition:
        raise repartition_refused(table, current, wanted, "it rewrites the table once")
    cur.execute(o.live_relays)
    live = [r[0] for r in cur.fetchall()]
    if live:
        raise repartition_while_running(table, live)
    # The rewrite waits for the table's metadata lock, and every write queues behind that
    # wait: a transaction left open (a relay the check above took for dead, a writer's long
    # transaction) must fail the change in seconds, not stall the writers indefinitely.
    cur.execute(f"SET SESSION lock_wait_timeout = {REPARTITION_LOCK_WAIT_S}")
    cur.execute(o.repartition.format(partitions=sql.check_partitions(wanted)))
    cur.execute("BEGIN")
    cur.execute(o.reset_partitions)
    cur.execute(o.fill_partitions, (wanted,))
    cur.execute("COMMIT")


def migrate_inbox(dsn: str, *, table: str = "processed_events") -> MigrationResult:
    """Create or upgrade the inbox table ``table``."""
    return migrate(dsn, table=table, kind="inbox")


def ddl(
    kind: sql.Kind,
    table: str,
    partitions: int = sql.DEFAULT_PARTITIONS,
    *,
    repartition: bool = False,
) -> str:
    """Every file's statements for ``table``, as one script (``--print-sql``); ordered
    mode's come after the outbox's own, then (``repartition``) the change of P."""
    kinds: list[sql.Kind] = ["outbox", "ordered"] if kind == "ordered" else [kind]
    script = "".join(
        f"{s};\n"
        for k in kinds
        for m in sql.migrations(k)
        for s in m.statements(sql.slots(k, table, partitions))
    )
    if repartition and kind == "ordered":
        o = OrderedStatements(table)
        fill = o.fill_partitions.replace("%s", str(sql.check_partitions(partitions)))
        script += f"{o.repartition.format(partitions=partitions)};\n{o.reset_partitions};\n"
        script += f"{fill};\n"
    return script
