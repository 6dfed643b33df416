"""What another migration tool (Django, Alembic) runs around the versioned ``.sql`` files.

``upgrade_statements`` is a version's file (``migrate.migration_statements``) between the
lock ``outboxkit migrate`` takes and the version record it keeps, so either tool can run
first and the other then finds the version recorded and everything in place. The record
is never lowered: a tool at version 1 does not undo what ``outboxkit migrate`` recorded.
``downgrade_statements`` undoes one version (the files have no down migrations: these
are the only down statements, one per version, tested against the files).
"""

from __future__ import annotations

from collections.abc import Iterator

from psycopg import sql

from outboxkit.backends.postgres.inbox_sql import DEFAULT_INBOX_TABLE, inbox_slots
from outboxkit.backends.postgres.migrate import migration_statements
from outboxkit.backends.postgres.migrations import Kind
from outboxkit.backends.postgres.postgres import (
    CREATE_VERSION_TABLE,
    DEFAULT_TABLE,
    VERSIONS_TABLE,
    migration_lock_key,
    parse_table,
    schema_slots,
    table_identifier,
)
from outboxkit.backends.postgres.tasks_sql import (
    tasks_migration_lock_key,
    tasks_slots,
)
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE

#: The kinds another tool applies: the plain outbox and task mode's table (versioned, as
#: ``outboxkit migrate`` records them) and the inbox (no record).
TOOL_KINDS: tuple[Kind, ...] = ("outbox", "inbox", "tasks")

_LOCK = "SELECT pg_advisory_xact_lock({key})"
RECORD_VERSION = """
INSERT INTO {versions} (table_name, version) VALUES ({table_name}, {version})
ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version, applied_at = now()
WHERE {versions}.version < EXCLUDED.version
"""
LOWER_VERSION = "UPDATE {versions} SET version = {previous} WHERE table_name = {table_name}"
FORGET_VERSION = "DELETE FROM {versions} WHERE table_name = {table_name}"

# One version's down statements per kind; {table} etc. are the files' own placeholders.
DOWNGRADES: dict[tuple[Kind, int], tuple[str, ...]] = {
    ("outbox", 1): ("DROP TABLE IF EXISTS {table}",),
    ("outbox", 2): (
        "ALTER TABLE {table} DROP COLUMN IF EXISTS occurred_at,"
        " DROP COLUMN IF EXISTS schema_version",
    ),
    ("inbox", 1): ("DROP TABLE IF EXISTS {table}",),
    ("tasks", 1): ("DROP TABLE IF EXISTS {table}", "DROP TABLE IF EXISTS {schedules}"),
    ("tasks", 2): (
        "ALTER TABLE {table} DROP COLUMN IF EXISTS lapses, DROP COLUMN IF EXISTS spared",
    ),
    ("tasks", 3): ("DROP TABLE IF EXISTS {queues}",),
    ("tasks", 11): ("DROP TABLE IF EXISTS {fair}",),
    ("tasks", 10): (  # (an older worker never promotes a parked task)
        "UPDATE {table} SET status = {pending}"
        " WHERE status = {waiting} AND key IS NULL AND after_failure IS NULL",
        "DROP INDEX IF EXISTS {index_parked_in_schema}",
    ),
    ("tasks", 9): ("DROP TABLE IF EXISTS {key_rates}",),
    ("tasks", 8): ("DROP TABLE IF EXISTS {limits}",),
    ("tasks", 7): ("DROP INDEX IF EXISTS {index_running_in_schema}",),
    ("tasks", 6): ("ALTER TABLE {table} DROP COLUMN IF EXISTS trace",),
    ("tasks", 5): (
        "DROP TABLE IF EXISTS {deps}",
        "ALTER TABLE {table} DROP COLUMN IF EXISTS has_dependents,"
        " DROP COLUMN IF EXISTS after_failure",
    ),
    ("tasks", 4): (
        "ALTER TABLE {table} DROP COLUMN IF EXISTS result, DROP COLUMN IF EXISTS progress,"
        " DROP COLUMN IF EXISTS keep_until",
    ),
}


def _table(kind: Kind, table: str | None) -> str:
    if kind not in TOOL_KINDS:
        raise ValueError(
            f"kind {kind!r}: other tools apply 'outbox', 'inbox' or 'tasks'; ordered mode and"
            " time partitions come from `outboxkit migrate --ordered / --partition-by`"
        )
    if kind == "tasks":
        return table or DEFAULT_TASKS_TABLE
    return table or (DEFAULT_INBOX_TABLE if kind == "inbox" else DEFAULT_TABLE)


def versions(kind: Kind) -> list[int]:
    """The schema versions of ``kind``, in order."""
    return [m.version for m in migration_statements(kind=kind)]


def _render(template: str, **slots: sql.Composable) -> str:
    return sql.SQL(template).format(**slots).as_string(None).strip()


def _record_slots(table: str, kind: Kind = "outbox") -> dict[str, sql.Composable]:
    schema, _name = parse_table(table)
    return {
        "versions": table_identifier(schema, VERSIONS_TABLE),
        # migrate.py's _record_key: the outbox's record is its table's name, a task table's
        # is "tasks:<table>"
        "table_name": sql.Literal(f"tasks:{table}" if kind == "tasks" else table),
    }


def upgrade_statements(table: str | None, *, kind: Kind, version: int) -> Iterator[str]:
    """The statements that bring ``table`` from ``version - 1`` to ``version``, recorded."""
    name = _table(kind, table)
    lock = f"inbox:{name}" if kind == "inbox" else name
    key = tasks_migration_lock_key(name) if kind == "tasks" else migration_lock_key(lock)
    yield _render(_LOCK, key=sql.Literal(key))
    found = [m for m in migration_statements(name, kind=kind) if m.version == version]
    if not found:
        raise ValueError(f"{kind} has no schema version {version}")
    yield from found[0].statements
    if kind in ("outbox", "tasks"):
        slots = _record_slots(name, kind)
        yield _render(CREATE_VERSION_TABLE, versions=slots["versions"])
        yield _render(RECORD_VERSION, version=sql.Literal(version), **slots)


def downgrade_statements(table: str | None, *, kind: Kind, version: int) -> Iterator[str]:
    """The statements that take ``table`` from ``version`` back to ``version - 1``."""
    name = _table(kind, table)
    try:
        down = DOWNGRADES[(kind, version)]
    except KeyError:
        raise ValueError(f"{kind} has no downgrade of schema version {version}") from None
    slots = {"inbox": inbox_slots, "tasks": tasks_slots}.get(kind, schema_slots)(name)
    for statement in down:
        yield _render(statement, **slots)
    if kind in ("outbox", "tasks"):
        rec = _record_slots(name, kind)
        if version == 1:
            # The record table may be gone already (a database rebuilt by hand).
            yield _render(CREATE_VERSION_TABLE, versions=rec["versions"])
            yield _render(FORGET_VERSION, **rec)
        else:
            yield _render(LOWER_VERSION, previous=sql.Literal(version - 1), **rec)
