"""Create, upgrade or repair an outbox table in place; safe to run twice or concurrently.

``migrate`` checks that what each applied version created is still there (the
table, its indexes, its columns, the version record) and recreates what is
missing: every migration is idempotent DDL (``IF NOT EXISTS``), so running it
again rebuilds exactly what was dropped and leaves the rest alone.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from outboxkit.errors import SchemaError
from outboxkit.store.inbox_sql import InboxStatements
from outboxkit.store.postgres import (
    DEFAULT_TABLE,
    MIGRATION_LOCK,
    MISSING_COLUMNS,
    MISSING_RELATIONS,
    SCHEMA_VERSION,
    Statements,
    migration_lock_key,
    parse_table,
    quote_table,
)

_NAME = r'"[^"]+"|\w+'
_CREATED = re.compile(
    rf"CREATE\s+(?:UNIQUE\s+)?(?P<kind>TABLE|INDEX)\s+(?:CONCURRENTLY\s+)?IF\s+NOT\s+EXISTS\s+"
    rf"(?P<name>(?:{_NAME})(?:\.(?:{_NAME}))?)"
    rf"|ADD\s+COLUMN\s+IF\s+NOT\s+EXISTS\s+(?P<column>{_NAME})",
    re.IGNORECASE,
)
_COMMENT = re.compile(r"--[^\n]*")


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

    def describe(self) -> str:
        """One line for an operator."""
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


def migrate(conninfo: str, *, table: str = DEFAULT_TABLE) -> MigrationResult:
    """Bring ``table`` to the current schema version, recreating whatever is missing.

    Everything happens in one transaction behind an advisory lock, so two
    deploys migrating at once serialise and the second finds nothing to do.
    """
    stmts = Statements(table)
    schema, _name = parse_table(table)
    by_version = {v: _objects(ddl, schema) for v, ddl in sorted(stmts.migrations.items())}
    everything = [o for objects in by_version.values() for o in objects]
    with psycopg.connect(conninfo) as conn, conn.transaction():
        conn.execute(MIGRATION_LOCK, (migration_lock_key(table),))
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
                return MigrationResult(table, MigrationAction.UNCHANGED, SCHEMA_VERSION, recorded)
        # Idempotent DDL: from version 1 when something is missing, else only the new ones.
        first = 1 if missing or recorded is None else recorded + 1
        for version in range(first, SCHEMA_VERSION + 1):
            conn.execute(stmts.migrations[version])
        conn.execute(stmts.set_version, (table, SCHEMA_VERSION))
        still = _missing(conn, everything, stmts.qualified)
        if still:
            raise SchemaError(
                f"migrating {table!r} left {', '.join(o.label for o in still)} missing;"
                " nothing was changed (report this as a bug)"
            )
    return MigrationResult(table, action, SCHEMA_VERSION, recorded, recreated)


def migrate_inbox(conninfo: str, *, table: str = "processed_events") -> MigrationResult:
    """Create the inbox table and its index if missing, and say which it was."""
    stmts = InboxStatements(table)
    schema, _name = parse_table(table)
    objects = _objects(stmts.create, schema)
    with psycopg.connect(conninfo) as conn, conn.transaction():
        # The same lock key as inbox_sql.migrate_inbox: the two serialise.
        conn.execute(MIGRATION_LOCK, (migration_lock_key(f"inbox:{table}"),))
        missing = _missing(conn, objects, stmts.qualified)
        if not missing:
            return MigrationResult(table, MigrationAction.UNCHANGED, None, kind="inbox")
        conn.execute(stmts.create)
    if any(o.name == stmts.qualified for o in missing):
        return MigrationResult(table, MigrationAction.CREATED, None, kind="inbox")
    labels = tuple(o.label for o in missing)
    return MigrationResult(table, MigrationAction.REPAIRED, None, recreated=labels, kind="inbox")


def schema_version(conninfo: str, *, table: str = DEFAULT_TABLE) -> int | None:
    """The recorded schema version of ``table``, or None if it was never migrated."""
    stmts = Statements(table)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (stmts.versions_table,))
        row = exists.fetchone()
        if not row or not row[0]:
            return None
        found = conn.execute(stmts.get_version, (table,)).fetchone()
        return int(found[0]) if found else None
