"""Create, upgrade or repair an outbox table in place; safe to run twice or concurrently.

``migrate`` checks that what each applied version created is still there (the
table, its indexes, its columns, the version record) and recreates what is
missing: every migration is idempotent DDL (``IF NOT EXISTS``), so running it
again rebuilds exactly what was dropped and leaves the rest alone.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from outboxkit.backends.postgres._connection import connect
from outboxkit.backends.postgres.inbox_sql import DEFAULT_INBOX_TABLE, InboxStatements, inbox_slots
from outboxkit.backends.postgres.migrations import Kind, migration_files
from outboxkit.backends.postgres.ordered_sql import (
    DEFAULT_PARTITIONS,
    PARTITION_EXPRESSION,
    OrderedStatements,
    check_partitions,
    ordered_slots,
)
from outboxkit.backends.postgres.partitions import (
    check_partition_by,
    finish_migration,
    prepare_migration,
)
from outboxkit.backends.postgres.postgres import (
    DEFAULT_TABLE,
    MIGRATION_LOCK,
    MISSING_COLUMNS,
    MISSING_RELATIONS,
    SCHEMA_VERSION,
    TABLE_EXISTS,
    Statements,
    migration_lock_key,
    parse_table,
    quote_table,
    schema_slots,
)
from outboxkit.backends.postgres.tasks_sql import (
    TaskStatements,
    tasks_migration_lock_key,
    tasks_slots,
)
from outboxkit.errors import SchemaError, repartition_refused, repartition_while_running
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE

_NAME = r'"[^"]+"|\w+'
_CREATED = re.compile(
    rf"CREATE\s+(?:UNIQUE\s+)?(?P<kind>TABLE|INDEX)\s+(?:CONCURRENTLY\s+)?IF\s+NOT\s+EXISTS\s+"
    rf"(?P<name>(?:{_NAME})(?:\.(?:{_NAME}))?)"
    rf"|ADD\s+COLUMN\s+IF\s+NOT\s+EXISTS\s+(?P<column>{_NAME})",
    re.IGNORECASE,
)
_COMMENT = re.compile(r"--[^\n]*")


#: ``migrate``'s connection in pg_stat_activity.
APPLICATION_NAME = "outboxkit-migrate"


def _connect(conninfo: str) -> psycopg.Connection[Any]:
    """A connection whose statements run in the one transaction the caller opens."""
    return connect(conninfo, application_name=APPLICATION_NAME, autocommit=False)


class MigrationAction(enum.StrEnum):
    """What ``migrate`` had to do."""

    CREATED = "created"
    UPGRADED = "upgraded"
    REPAIRED = "repaired"
    UNCHANGED = "unchanged"


@dataclass(frozen=True, slots=True)
class MigrationResult:
    """The outcome of one migration: the action, the version reached and what was rebuilt."""

    table: str
    action: MigrationAction
    version: int | None
    previous_version: int | None = None
    recreated: tuple[str, ...] = ()
    kind: str = "outbox"
    #: Ordered mode (``migrate(ordered=True)``): the partition count, and what it added.
    partitions: int | None = None
    ordered_added: tuple[str, ...] = ()
    #: Time partitions (``migrate(partition_by=...)``): the ones this run created.
    partition_by: str | None = None
    created_partitions: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for an operator."""
        line = self._describe_table() + self._describe_time_partitions()
        if self.partitions is None:
            return line
        if not self.ordered_added:
            return f"{line}; ordered mode in place with {self.partitions} partitions"
        if self.action is MigrationAction.UNCHANGED:  # (not "nothing to do": it added some)
            line = line.replace(": nothing to do", "")
        return (
            f"{line}; ordered mode with {self.partitions} partitions:"
            f" added {', '.join(self.ordered_added)}"
        )

    def _describe_time_partitions(self) -> str:
        if self.partition_by is None:
            return ""
        made = self.created_partitions
        new = f", created {', '.join(made)}" if made else ", partitions in place"
        return f"; partitioned by {self.partition_by}{new}"

    def _describe_table(self) -> str:
        what = f"{self.kind} table {self.table!r}"
        at = "" if self.version is None else f" at schema version {self.version}"
        rebuilt = f": recreated the missing {', '.join(self.recreated)}" if self.recreated else ""
        if self.action is MigrationAction.CREATED:
            return f"created {what}{at}"
        if self.action is MigrationAction.UPGRADED:
            return (
                f"upgraded {what} to schema version {self.version}"
                f" (from {self.previous_version}){rebuilt}"
            )
        if self.action is MigrationAction.REPAIRED:
            return f"repaired {what}{at}{rebuilt}"
        return f"{what} is in place{at}: nothing to do"


@dataclass(frozen=True, slots=True)
class _Object:
    """One schema object a migration creates: a relation by regclass name, or a column."""

    kind: str  # "table", "index" or "column"
    name: str  # quoted regclass name, or a column name

    @property
    def label(self) -> str:
        plain = self.name.replace('"', "")
        return f"{self.kind} {plain}"


def _objects(ddl: str, schema: str | None) -> list[_Object]:
    """The tables, indexes and added columns ``ddl`` creates, qualified like the table."""
    found = []
    for m in _CREATED.finditer(_COMMENT.sub("", ddl)):
        if m.group("column"):
            found.append(_Object("column", m.group("column").strip('"')))
            continue
        name = m.group("name")
        if schema is not None and "." not in name:
            # An index lives in its table's schema whatever the search_path says.
            name = f"{quote_table(None, schema)}.{name}"
        found.append(_Object(m.group("kind").lower(), name))
    return found


def _missing(
    conn: psycopg.Connection[Any], objects: Sequence[_Object], table: str
) -> list[_Object]:
    relations = [o for o in objects if o.kind != "column"]
    columns = [o for o in objects if o.kind == "column"]
    gone = {r for (r,) in conn.execute(MISSING_RELATIONS, ([o.name for o in relations],))}
    if columns and table not in gone:
        gone |= {c for (c,) in conn.execute(MISSING_COLUMNS, ([o.name for o in columns], table))}
    # Columns of a missing table come back with it: name the table only.
    return [o for o in objects if o.name in gone and not (o.kind == "column" and table in gone)]


def migrate(
    conninfo: str,
    *,
    table: str = DEFAULT_TABLE,
    ordered: bool = False,
    partitions: int | None = None,
    repartition: bool = False,
    partition_by: str | None = None,
) -> MigrationResult:
    """Bring ``table`` to the current schema version, recreating whatever is missing.

    Everything happens in one transaction behind an advisory lock, so two
    deploys migrating at once serialise and the second finds nothing to do.

    ``ordered=True`` adds ordered mode (per-key order across relays): the ``partition``
    column (``partitions`` of them, default 64, or the table's current count), its
    indexes and the ``<table>_partitions`` / ``<table>_relays`` lease tables. Changing
    the count of an ordered table needs ``repartition=True`` with every relay stopped.

    ``partition_by="day"|"hour"`` creates the table range-partitioned by ``created_at``
    (backends/postgres/partitions.py), with the partitions of now and of the next periods; an
    existing plain table holding rows is refused (docs/operations.md, "Partitioned outbox").
    """
    by = None if partition_by is None else check_partition_by(partition_by)
    if (partitions is not None or repartition) and not ordered:
        raise SchemaError("partitions and repartition apply to ordered mode: add ordered=True")
    if partitions is not None:
        check_partitions(partitions)
    stmts = Statements(table)
    schema, _name = parse_table(table)
    scripts = stmts.scripts("outbox" if by is None else "partitioned")
    by_version = {v: _objects(ddl, schema) for v, ddl in sorted(scripts.items())}
    everything = [o for objects in by_version.values() for o in objects]
    with _connect(conninfo) as conn, conn.transaction():
        conn.execute(MIGRATION_LOCK, (migration_lock_key(table),))
        if by is not None:
            prepare_migration(conn, stmts, by)  # the partitioned DDL, or a refusal
        conn.execute(stmts.create_version_table)
        row = conn.execute(stmts.get_version, (table,)).fetchone()
        recorded = int(row[0]) if row else None
        if recorded is not None and recorded > SCHEMA_VERSION:
            raise SchemaError(
                f"outbox table {table!r} is at schema version {recorded}, newer than this"
                f" outboxkit knows ({SCHEMA_VERSION}): upgrade outboxkit"
            )
        applied = recorded if recorded is not None else SCHEMA_VERSION
        expected = [o for v, objects in by_version.items() if v <= applied for o in objects]
        missing = _missing(conn, expected, stmts.qualified)
        recreated: tuple[str, ...] = ()
        if recorded is None and any(o.name == stmts.qualified for o in missing):
            action = MigrationAction.CREATED
        else:
            labels = [o.label for o in missing]
            if recorded is None:
                labels.append("version record")
            recreated = tuple(labels)
            if recorded is not None and recorded < SCHEMA_VERSION:
                action = MigrationAction.UPGRADED
            elif recreated:
                action = MigrationAction.REPAIRED
            else:
                result = MigrationResult(table, MigrationAction.UNCHANGED, SCHEMA_VERSION, recorded)
                if by is not None:
                    made = tuple(finish_migration(conn, table, by))
                    result = dataclasses.replace(result, partition_by=by, created_partitions=made)
                if ordered:
                    result = _migrate_ordered(conn, result, partitions, repartition)
                return result
        # Idempotent DDL: from version 1 when something is missing, else only the new ones.
        first = 1 if missing or recorded is None else recorded + 1
        for version in range(first, SCHEMA_VERSION + 1):
            conn.execute(scripts[version])
        conn.execute(stmts.set_version, (table, SCHEMA_VERSION))
        still = _missing(conn, everything, stmts.qualified)
        if still:
            raise SchemaError(
                f"migrating {table!r} left {', '.join(o.label for o in still)} missing;"
                " nothing was changed (report this as a bug)"
            )
        result = MigrationResult(table, action, SCHEMA_VERSION, recorded, recreated)
        if by is not None:
            made = tuple(finish_migration(conn, table, by))
            result = dataclasses.replace(result, partition_by=by, created_partitions=made)
        return _migrate_ordered(conn, result, partitions, repartition) if ordered else result


def _column_partitions(conn: psycopg.Connection[Any], stmts: OrderedStatements) -> int | None:
    """P as the partition column computes it, or None without the column."""
    row = conn.execute(PARTITION_EXPRESSION, (stmts.qualified,)).fetchone()
    if not row:
        return None
    found = re.search(r"\(?(\d+)\)?(?:::bigint)?\)\)::smallint\s*$", str(row[0]))
    if not found:
        raise SchemaError(
            f"the partition column of {stmts.table!r} is not the one `migrate --ordered`"
            f" creates ({row[0]}): drop it and migrate again"
        )
    return int(found.group(1))


def _migrate_ordered(
    conn: psycopg.Connection[Any],
    result: MigrationResult,
    partitions: int | None,
    repartition: bool,
) -> MigrationResult:
    """Add (or repair) ordered mode in the migrating transaction; refuse a silent change of P."""
    stmts = OrderedStatements(result.table)
    schema, _name = parse_table(result.table)
    current = _column_partitions(conn, stmts)
    wanted = partitions if partitions is not None else (current or DEFAULT_PARTITIONS)
    if current is not None and current != wanted:
        if not repartition:
            raise repartition_refused(
                result.table, current, wanted, "it rewrites the table once under an exclusive lock"
            )
        if conn.execute(TABLE_EXISTS, (stmts.relays_table,)).fetchone() == (True,):
            live = [r for (r,) in conn.execute(stmts.live_relays)]
            if live:
                raise repartition_while_running(result.table, live)
        conn.execute(stmts.repartition_ddl())
    ddl = stmts.ordered_ddl(wanted)
    missing = _missing(conn, _objects(ddl, schema), stmts.qualified)
    conn.execute(ddl)
    _record(conn, result.table, "ordered", len(migration_files("ordered")))
    added = tuple(o.label for o in missing)
    return dataclasses.replace(result, partitions=wanted, ordered_added=added)


def _record_key(kind: Kind, table: str) -> str:
    """The version record of ``kind`` for ``table``: the table's name for the outbox (plain
    or partitioned: one history), ``ordered:<table>`` and ``inbox:<table>`` for the others."""
    return table if kind in ("outbox", "partitioned") else f"{kind}:{table}"


def _record(conn: psycopg.Connection[Any], table: str, kind: Kind, version: int) -> None:
    """Record that ``table`` has ``kind``'s files up to ``version`` (unless it says so already)."""
    stmts = Statements(table)
    key = _record_key(kind, table)
    conn.execute(stmts.create_version_table)
    row = conn.execute(stmts.get_version, (key,)).fetchone()
    if row is None or int(row[0]) != version:
        conn.execute(stmts.set_version, (key, version))


def migrate_inbox(conninfo: str, *, table: str = DEFAULT_INBOX_TABLE) -> MigrationResult:
    """Create the inbox table and its index if missing, and say which it was.

    Safe to run twice or concurrently (two ``CREATE ... IF NOT EXISTS`` can still collide
    in the catalog: an advisory lock serialises them).
    """
    stmts = InboxStatements(table)
    schema, _name = parse_table(table)
    ddl = stmts.ddl()
    objects = _objects(ddl, schema)
    version = len(migration_files("inbox"))
    with _connect(conninfo) as conn, conn.transaction():
        conn.execute(MIGRATION_LOCK, (migration_lock_key(f"inbox:{table}"),))
        missing = _missing(conn, objects, stmts.qualified)
        if missing:
            conn.execute(ddl)
        _record(conn, table, "inbox", version)
    if not missing:
        return MigrationResult(table, MigrationAction.UNCHANGED, version, kind="inbox")
    if any(o.name == stmts.qualified for o in missing):
        return MigrationResult(table, MigrationAction.CREATED, version, kind="inbox")
    labels = tuple(o.label for o in missing)
    return MigrationResult(table, MigrationAction.REPAIRED, version, recreated=labels, kind="inbox")


def migrate_tasks(conninfo: str, *, table: str = DEFAULT_TASKS_TABLE) -> MigrationResult:
    """Create the task table, its indexes and the schedules table if missing (task mode).

    As :func:`migrate_inbox`: idempotent, serialised by an advisory lock, the version recorded.
    """
    stmts = TaskStatements(table)
    schema, _name = parse_table(table)
    ddl = stmts.ddl()
    objects = _objects(ddl, schema)
    version = len(migration_files("tasks"))
    with _connect(conninfo) as conn, conn.transaction():
        conn.execute(MIGRATION_LOCK, (tasks_migration_lock_key(table),))
        missing = _missing(conn, objects, stmts.qualified)
        if missing:
            conn.execute(ddl)
        _record(conn, table, "tasks", version)
    if not missing:
        return MigrationResult(table, MigrationAction.UNCHANGED, version, kind="task")
    if any(o.name == stmts.qualified for o in missing):
        return MigrationResult(table, MigrationAction.CREATED, version, kind="task")
    labels = tuple(o.label for o in missing)
    return MigrationResult(table, MigrationAction.REPAIRED, version, recreated=labels, kind="task")


def schema_version(
    conninfo: str, *, table: str = DEFAULT_TABLE, kind: Kind = "outbox"
) -> int | None:
    """The recorded schema version of ``table`` (of its ordered mode or of an inbox with
    ``kind``), or None if it was never migrated."""
    stmts = Statements(table)
    with connect(conninfo, application_name=APPLICATION_NAME) as conn:
        row = conn.execute(TABLE_EXISTS, (stmts.versions_table,)).fetchone()
        if not row or not row[0]:
            return None
        found = conn.execute(stmts.get_version, (_record_key(kind, table),)).fetchone()
        return int(found[0]) if found else None


@dataclass(frozen=True, slots=True)
class RenderedMigration:
    """One schema version's statements for one table, ready for any migration tool."""

    kind: Kind
    version: int
    name: str  # its file, e.g. "0002_occurred_at.sql"
    description: str  # the file's header comment: what the version does and why
    statements: tuple[str, ...]


def migration_statements(
    table: str | None = None, *, kind: Kind = "outbox", partitions: int = DEFAULT_PARTITIONS
) -> Iterator[RenderedMigration]:
    """The statements of each schema version of ``kind`` for ``table``, in version order.

    For a migration tool of your own (a Django migration, an Alembic revision, a DBA's
    scripts): apply each version once, in order, in one transaction, and record that it
    ran. ``kind`` is ``outbox`` (``table`` defaults to ``outbox``), ``partitioned`` (the
    same table range-partitioned by ``created_at``: its partitions and their settings come
    from ``outboxkit migrate --partition-by`` or the relay's maintenance, see
    docs/operations.md), ``ordered`` (ordered mode on top of an outbox, with ``partitions``
    partitions), ``inbox`` (``table`` defaults to ``processed_events``) or ``tasks`` (task
    mode's table, default ``outboxkit_tasks``, and its schedules table). Every statement
    is idempotent (``IF NOT EXISTS``), so applying a version twice does no harm;
    ``outboxkit migrate`` applies the same files.
    """
    if kind == "inbox":
        slots = inbox_slots(table or DEFAULT_INBOX_TABLE)
    elif kind == "tasks":
        slots = tasks_slots(table or DEFAULT_TASKS_TABLE)
    elif kind == "ordered":
        slots = ordered_slots(table or DEFAULT_TABLE, partitions)
    else:
        slots = schema_slots(table or DEFAULT_TABLE)
    for f in migration_files(kind):
        yield RenderedMigration(kind, f.version, f.name, f.description, tuple(f.statements(slots)))
