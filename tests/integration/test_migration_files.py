"""A schema upgraded from any earlier version equals one created fresh, on the real PostgreSQL.

Each case builds the same table twice, in two schemas of one database: once by ``migrate``
on an empty schema, once from an earlier version (made by the released files, which
tests/unit/test_migration_files.py pins) upgraded by ``migrate``; then diffs the catalog:
columns, types, defaults, identity and generated columns, indexes with their predicates,
constraints, storage options, partitioning. Applying the files one statement at a time
(``migration_statements``, what a Django or Alembic migration runs) gives the same schema.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest

from outboxkit.backends.postgres.migrate import (
    MigrationAction,
    migrate,
    migrate_inbox,
    migration_statements,
    schema_version,
)
from outboxkit.backends.postgres.migrations import Kind, migration_files
from outboxkit.backends.postgres.postgres import SCHEMA_VERSION, VERSIONS_TABLE, Statements

_RELATIONS = """
SELECT c.relname, c.relkind::text, coalesce(c.reloptions, '{}'), pg_get_partkeydef(c.oid),
       pg_get_expr(c.relpartbound, c.oid), obj_description(c.oid, 'pg_class')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s ORDER BY c.relname
"""
_COLUMNS = """
SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       pg_get_expr(d.adbin, d.adrelid), a.attidentity::text, a.attgenerated::text
FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE n.nspname = %s AND c.relkind IN ('r', 'p') AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY c.relname, a.attnum
"""
_INDEXES = """
SELECT c.relname, i.relname, pg_get_indexdef(x.indexrelid), x.indisunique, x.indisprimary
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class c ON c.oid = x.indrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s ORDER BY c.relname, i.relname
"""
# PostgreSQL 18 lists NOT NULL as constraints (contype 'n') with generated names; the
# columns' part compares nullability on every version already.
_CONSTRAINTS = """
SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid)
FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND k.contype <> 'n' ORDER BY c.relname, k.conname
"""


def _catalog(conn: psycopg.Connection[Any], schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """Everything the schema's tables are made of, with the schema's name taken out."""

    def plain(value: Any) -> Any:
        return value.replace(f"{schema}.", "") if isinstance(value, str) else value

    # The version records are bookkeeping (asserted by schema_version), not the schema.
    return {
        name: [
            tuple(plain(v) for v in row)
            for row in conn.execute(query, (schema,))
            if not row[0].startswith(VERSIONS_TABLE)
        ]
        for name, query in [
            ("relations", _RELATIONS),
            ("columns", _COLUMNS),
            ("indexes", _INDEXES),
            ("constraints", _CONSTRAINTS),
        ]
    }


def _apply(dsn: str, table: str, kind: Kind, *, through: int, partitions: int = 64) -> None:
    """The files of ``kind`` up to version ``through``, one statement at a time."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        for m in migration_statements(table, kind=kind, partitions=partitions):
            if m.version <= through:
                for statement in m.statements:
                    conn.execute(statement)


def _record(dsn: str, table: str, version: int) -> None:
    """The version record the outboxkit that applied ``version`` left."""
    stmts = Statements(table)
    with psycopg.connect(dsn) as conn, conn.transaction():
        conn.execute(stmts.create_version_table)
        conn.execute(stmts.set_version, (table, version))


def _schemas(dsn: str, *names: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(f"CREATE SCHEMA {name}")


def _diff(dsn: str, fresh: str, other: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        a, b = _catalog(conn, fresh), _catalog(conn, other)
    assert a["columns"], f"nothing in schema {fresh}"
    for part in a:
        assert a[part] == b[part], f"{part} of {other} differ from {fresh}"


@pytest.mark.parametrize("start", range(1, SCHEMA_VERSION))
def test_an_outbox_upgraded_from_any_version_equals_a_fresh_one(
    empty_db_dsn: str, start: int
) -> None:
    _schemas(empty_db_dsn, "fresh", "old")
    assert migrate(empty_db_dsn, table="fresh.outbox").action is MigrationAction.CREATED
    _apply(empty_db_dsn, "old.outbox", "outbox", through=start)
    _record(empty_db_dsn, "old.outbox", start)
    result = migrate(empty_db_dsn, table="old.outbox")
    assert result.action is MigrationAction.UPGRADED
    assert (result.previous_version, result.version) == (start, SCHEMA_VERSION)
    _diff(empty_db_dsn, "fresh", "old")


def test_every_outbox_version_applied_without_a_record_is_recognised(empty_db_dsn: str) -> None:
    # A table made from --print-sql of an old version, by hand, with no version record.
    for start in range(1, SCHEMA_VERSION + 1):
        schema = f"v{start}"
        _schemas(empty_db_dsn, schema)
        _apply(empty_db_dsn, f"{schema}.outbox", "outbox", through=start)
        result = migrate(empty_db_dsn, table=f"{schema}.outbox")
        assert result.version == SCHEMA_VERSION, result.describe()
    _schemas(empty_db_dsn, "fresh")
    migrate(empty_db_dsn, table="fresh.outbox")
    for start in range(1, SCHEMA_VERSION + 1):
        _diff(empty_db_dsn, "fresh", f"v{start}")


def test_the_files_statement_by_statement_make_what_migrate_makes(empty_db_dsn: str) -> None:
    # What a Django migration or an Alembic revision applies through migration_statements.
    _schemas(empty_db_dsn, "fresh", "files")
    migrate(empty_db_dsn, table="fresh.outbox", ordered=True, partitions=8)
    migrate_inbox(empty_db_dsn, table="fresh.processed_events")
    _apply(empty_db_dsn, "files.outbox", "outbox", through=SCHEMA_VERSION)
    _apply(empty_db_dsn, "files.outbox", "ordered", through=1, partitions=8)
    _apply(empty_db_dsn, "files.processed_events", "inbox", through=1)
    _record(empty_db_dsn, "files.outbox", SCHEMA_VERSION)
    _diff(empty_db_dsn, "fresh", "files")
    assert schema_version(empty_db_dsn, table="files.outbox") == SCHEMA_VERSION
    assert schema_version(empty_db_dsn, table="files.outbox", kind="ordered") is None
    again = migrate(empty_db_dsn, table="files.outbox", ordered=True, partitions=8)
    assert again.action is MigrationAction.UNCHANGED and not again.ordered_added
    inbox = migrate_inbox(empty_db_dsn, table="files.processed_events")
    assert inbox.action is MigrationAction.UNCHANGED and inbox.version == 1
    # each kind's version is recorded beside the outbox's (what a later file upgrades from)
    for schema in ("fresh", "files"):
        table, inbox_table = f"{schema}.outbox", f"{schema}.processed_events"
        assert schema_version(empty_db_dsn, table=table) == SCHEMA_VERSION
        assert schema_version(empty_db_dsn, table=table, kind="ordered") == len(
            migration_files("ordered")
        )
        assert schema_version(empty_db_dsn, table=inbox_table, kind="inbox") == len(
            migration_files("inbox")
        )


def test_ordered_mode_added_to_an_old_outbox_equals_a_fresh_ordered_one(
    empty_db_dsn: str,
) -> None:
    _schemas(empty_db_dsn, "fresh", "old")
    migrate(empty_db_dsn, table="fresh.outbox", ordered=True, partitions=8)
    _apply(empty_db_dsn, "old.outbox", "outbox", through=1)
    _record(empty_db_dsn, "old.outbox", 1)
    result = migrate(empty_db_dsn, table="old.outbox", ordered=True, partitions=8)
    assert result.action is MigrationAction.UPGRADED and result.partitions == 8
    _diff(empty_db_dsn, "fresh", "old")


def test_a_partitioned_outbox_upgraded_equals_a_fresh_one_and_mirrors_the_plain_one(
    empty_db_dsn: str,
) -> None:
    _schemas(empty_db_dsn, "fresh", "old", "plain")
    migrate(empty_db_dsn, table="fresh.outbox", partition_by="day")
    _apply(empty_db_dsn, "old.outbox", "partitioned", through=1)
    _record(empty_db_dsn, "old.outbox", 1)
    result = migrate(empty_db_dsn, table="old.outbox", partition_by="day")
    assert result.action is MigrationAction.UPGRADED
    if dt.datetime.now(dt.UTC).hour != 0:  # both made today's partitions (not across midnight)
        _diff(empty_db_dsn, "fresh", "old")

    # The partitioned table has the plain table's columns and indexes; its partitions get the
    # plain table's storage settings. Only the primary key differs (it holds created_at).
    migrate(empty_db_dsn, table="plain.outbox")
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        parted, plain = _catalog(conn, "fresh"), _catalog(conn, "plain")
    assert [r[1:] for r in parted["columns"] if r[0] == "outbox"] == [
        r[1:] for r in plain["columns"] if r[0] == "outbox"
    ]

    def indexes(catalog: dict[str, list[tuple[Any, ...]]]) -> list[tuple[Any, ...]]:
        # a partitioned table's index is defined "ON ONLY" the parent
        return [
            (r[1], r[2].replace(" ON ONLY ", " ON "), r[3])
            for r in catalog["indexes"]
            if r[0] == "outbox" and not r[4]
        ]

    assert indexes(parted) == indexes(plain) and len(indexes(plain)) == 3
    (plain_options,) = [r[2] for r in plain["relations"] if r[0] == "outbox"]
    children = [r for r in parted["relations"] if r[0].startswith("outbox_") and r[1] == "r"]
    assert children and all(r[2] == plain_options for r in children), children
    assert [r[3] for r in parted["constraints"] if r[0] == "outbox"] == [
        "PRIMARY KEY (id, created_at)"
    ]
    assert [r[3] for r in plain["constraints"] if r[0] == "outbox"] == ["PRIMARY KEY (id)"]


def test_an_inbox_made_from_its_files_or_by_migrate_inbox_is_the_same(empty_db_dsn: str) -> None:
    _schemas(empty_db_dsn, "fresh", "files")
    assert migrate_inbox(empty_db_dsn, table="fresh.inbox").action is MigrationAction.CREATED
    _apply(empty_db_dsn, "files.inbox", "inbox", through=1)
    _diff(empty_db_dsn, "fresh", "files")
