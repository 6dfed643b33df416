"""``outboxkit migrate`` on MariaDB/MySQL: apply the kind's versioned files not yet recorded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outboxkit.backends.mariadb import sql
from outboxkit.errors import ConfigurationError, StoreError, StoreUnavailable


@dataclass(frozen=True, slots=True)
class MigrationResult:
    """What a migrate run did, for its one-line report."""

    kind: str
    table: str
    applied: list[int]
    version: int

    def describe(self) -> str:
        if not self.applied:
            return f"{self.kind} table {self.table!r} is up to date (schema version {self.version})"
        return (
            f"{self.kind} table {self.table!r} migrated to schema version {self.version}"
            f" (applied {', '.join(str(v) for v in self.applied)}) on MariaDB"
        )


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
    partitions: int = sql.DEFAULT_PARTITIONS,
) -> MigrationResult:
    """Create or upgrade ``table`` (idempotent; concurrent runs wait on a named lock).

    ``kind="ordered"`` adds ordered mode to the outbox ``table`` (created first if need be)
    with ``partitions`` key partitions; P is fixed once set (a later run leaves it).
    """
    import pymysql

    if kind == "ordered":
        migrate(dsn, table=table)
    files = sql.migrations(kind)
    slots = sql.slots(kind, table, partitions)
    conn = connect(dsn, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.MIGRATE_LOCK)
            try:
                cur.execute(sql.CREATE_VERSIONS)
                cur.execute(sql.APPLIED_VERSIONS, (kind, table))
                done = {int(r[0]) for r in cur.fetchall()}
                applied = []
                for migration in files:
                    if migration.version in done:
                        continue
                    # DDL commits implicitly on MariaDB: each statement is idempotent.
                    for statement in migration.statements(slots):
                        cur.execute(statement)
                    cur.execute(sql.RECORD_VERSION, (kind, table, migration.version))
                    applied.append(migration.version)
            finally:
                cur.execute(sql.MIGRATE_UNLOCK)
    except pymysql.err.MySQLError as exc:
        raise StoreError(
            f"migrating the {kind} table {table!r} on MariaDB failed: {exc.args[-1]}", cause=exc
        ) from None
    finally:
        conn.close()
    return MigrationResult(kind, table, applied, files[-1].version)


def migrate_inbox(dsn: str, *, table: str = "processed_events") -> MigrationResult:
    """Create or upgrade the inbox table ``table``."""
    return migrate(dsn, table=table, kind="inbox")


def ddl(kind: sql.Kind, table: str, partitions: int = sql.DEFAULT_PARTITIONS) -> str:
    """Every file's statements for ``table``, as one script (``--print-sql``); ordered
    mode's come after the outbox's own."""
    kinds: list[sql.Kind] = ["outbox", "ordered"] if kind == "ordered" else [kind]
    return "".join(
        f"{s};\n"
        for k in kinds
        for m in sql.migrations(k)
        for s in m.statements(sql.slots(k, table, partitions))
    )
