"""The inbox's PostgreSQL side: its schema, its statements, and the migrate/purge that run them.

Kept apart from ``postgres.py`` (the outbox's statements) because a consumer's
database usually has an inbox and no outbox. Table names go through the same
validation and quoting (:func:`parse_table`, :func:`quote_table`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from psycopg import sql

from outboxkit.backends.postgres._connection import admin_connection
from outboxkit.backends.postgres.migrations import migration_files
from outboxkit.backends.postgres.postgres import (
    NamedStatements,
    SqlTemplate,
    parse_table,
    quote_table,
    table_identifier,
)
from outboxkit.errors import SchemaError
from outboxkit.maintenance.purge import in_batches

DEFAULT_INBOX_TABLE = "processed_events"

# The inbox's schema: the files of backends/postgres/migrations/inbox/ (the primary key is the
# dedup).
CREATE_INBOX = "\n".join(f.template for f in migration_files("inbox"))
# RETURNING makes "inserted or not" one fetch in every driver (rowcount is not uniform).
MARK_PROCESSED = """
INSERT INTO {table} (consumer_name, event_id) VALUES (%s, %s::uuid)
ON CONFLICT DO NOTHING RETURNING true
"""
IS_PROCESSED = (
    "SELECT EXISTS (SELECT 1 FROM {table} WHERE consumer_name = %s AND event_id = %s::uuid)"
)
PURGE_PROCESSED_BATCH = """
DELETE FROM {table} WHERE (consumer_name, event_id) IN (
    SELECT consumer_name, event_id FROM {table}
    WHERE processed_at < now() - make_interval(secs => %(age)s)
      AND (%(consumer)s::text IS NULL OR consumer_name = %(consumer)s)
    ORDER BY processed_at LIMIT %(limit)s
)
"""
COUNT_PURGEABLE_PROCESSED = """
SELECT count(*) FROM {table}
WHERE processed_at < now() - make_interval(secs => %(age)s)
  AND (%(consumer)s::text IS NULL OR consumer_name = %(consumer)s)
"""


class InboxStatements(NamedStatements):
    """The statements of one inbox table, rendered once with its quoted name."""

    create = SqlTemplate(CREATE_INBOX)
    mark = SqlTemplate(MARK_PROCESSED)
    is_processed = SqlTemplate(IS_PROCESSED)
    purge_batch = SqlTemplate(PURGE_PROCESSED_BATCH)
    count_purgeable = SqlTemplate(COUNT_PURGEABLE_PROCESSED)

    def __init__(self, table: str = DEFAULT_INBOX_TABLE) -> None:
        schema, name = parse_table(table)
        self.table = table
        self.qualified = quote_table(schema, name)
        self._render(
            {
                "table": self.qualified,
                "index_processed_at": quote_table(None, f"{name}_processed_at_idx"[:63]),
            }
        )

    def ddl(self) -> str:
        """The inbox schema as one script, for users who run their own migration tool."""
        slots = inbox_slots(self.table)
        return "\n".join(f.render(slots) for f in migration_files("inbox")).strip() + "\n"


def inbox_slots(table: str) -> dict[str, sql.Composable]:
    """The placeholders of the inbox's migration files for ``table``."""
    schema, name = parse_table(table)
    return {
        "table": table_identifier(schema, name),
        "index_processed_at": sql.Identifier(f"{name}_processed_at_idx"[:63]),
    }


def purge_inbox(
    conninfo: str,
    *,
    older_than: dt.timedelta,
    table: str = DEFAULT_INBOX_TABLE,
    consumer: str | None = None,
    batch_size: int = 1000,
    pause: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete inbox records older than ``older_than`` in short transactions; returns the count.

    Keep the records longer than any redelivery can arrive (broker retention,
    relay retries): a purged record no longer stops a late duplicate.
    """
    stmts = InboxStatements(table)
    params = {"age": older_than.total_seconds(), "consumer": consumer, "limit": batch_size}
    with _connect(conninfo, table) as conn:
        return in_batches(
            lambda: conn.execute(stmts.purge_batch, params).rowcount,
            batch_size=batch_size,
            pause=pause,
            progress=progress,
        )


def count_inbox_purgeable(
    conninfo: str,
    *,
    older_than: dt.timedelta,
    table: str = DEFAULT_INBOX_TABLE,
    consumer: str | None = None,
) -> int:
    """How many records a purge would delete (for a progress bar)."""
    stmts = InboxStatements(table)
    params = {"age": older_than.total_seconds(), "consumer": consumer}
    with _connect(conninfo, table) as conn:
        row = conn.execute(stmts.count_purgeable, params).fetchone()
    return int(row[0]) if row else 0


def _connect(conninfo: str, table: str) -> AbstractContextManager[psycopg.Connection[Any]]:
    return admin_connection(
        conninfo,
        lambda: SchemaError(
            f"inbox table {table!r} not found: run `outboxkit migrate --inbox"
            f" --inbox-table {table}`"
        ),
    )
