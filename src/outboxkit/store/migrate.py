"""Create or upgrade an outbox table in place; safe to run twice or concurrently."""

from __future__ import annotations

import psycopg

from outboxkit.store.postgres import (
    MIGRATION_LOCK,
    SCHEMA_VERSION,
    TABLE_EXISTS,
    Statements,
    migration_lock_key,
)


def migrate(conninfo: str, *, table: str = "outbox") -> int:
    """Bring ``table`` to the current schema version and return that version.

    Everything happens in one transaction behind an advisory lock, so two
    deploys migrating at once serialise and the second finds nothing to do.
    """
    stmts = Statements(table)
    with psycopg.connect(conninfo) as conn, conn.transaction():
        conn.execute(MIGRATION_LOCK, (migration_lock_key(table),))
        conn.execute(stmts.create_version_table)
        row = conn.execute(stmts.get_version, (table,)).fetchone()
        current = int(row[0]) if row else 0
        if current == 0:
            # A table created by hand from `migrate --print-sql` without the record.
            exists = conn.execute(TABLE_EXISTS, (stmts.qualified,)).fetchone()
            if exists and exists[0]:
                current = 0  # CREATE ... IF NOT EXISTS makes version 1 a no-op
        for version in range(current + 1, SCHEMA_VERSION + 1):
            conn.execute(stmts.migrations[version])
        if current != SCHEMA_VERSION:
            conn.execute(stmts.set_version, (table, SCHEMA_VERSION))
    return SCHEMA_VERSION


def schema_version(conninfo: str, *, table: str = "outbox") -> int | None:
    """The recorded schema version of ``table``, or None if it was never migrated."""
    stmts = Statements(table)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (stmts.versions_table,))
        row = exists.fetchone()
        if not row or not row[0]:
            return None
        found = conn.execute(stmts.get_version, (table,)).fetchone()
        return int(found[0]) if found else None
