"""The WAL write's statements (``Outbox(storage="wal")``): one logical message per event.

``pg_logical_emit_message(true, prefix, envelope)`` writes a transactional message
into the WAL: logical decoding hands it over with its transaction's commit, and never
if the transaction rolls back. No heap row, no index entry, nothing to vacuum. It needs
no outbox table and works at any ``wal_level``; only a decoder (the CDC relay's slot)
needs ``wal_level = logical``. The prefix names the outbox, so one slot can carry several.
"""

from __future__ import annotations

from psycopg import sql

from outboxkit.backends.postgres.postgres import (
    NamedStatements,
    SqlTemplate,
    channel_for,
    parse_table,
    quote_table,
)

#: A WAL event's logical message prefix is this followed by the outbox's name.
PREFIX = "outboxkit:"

# One event: the envelope is the only parameter (bytea).
EMIT_ONE = "SELECT pg_logical_emit_message(true, {prefix}, %s::bytea)"
# Any number of events in one statement and one round trip, in the array's order. The
# aggregate consumes every row (so every message is written) and returns one.
EMIT_MANY = "SELECT count(pg_logical_emit_message(true, {prefix}, e)) FROM unnest(%s::bytea[]) AS e"
# The NOTIFY rides in the same statement, evaluated once, its channel the last parameter
# (only if the application asked for it: the CDC relay reads the stream and needs none).
NOTIFY_ONE = "SELECT pg_logical_emit_message(true, {prefix}, %s::bytea), pg_notify(%s, '')"
NOTIFY_MANY = (
    "SELECT m.n, pg_notify(%s, '') FROM ("
    "SELECT count(pg_logical_emit_message(true, {prefix}, e)) FROM unnest(%s::bytea[]) AS e"
    ") AS m(n)"
)

# Events attached to the caller's own statement (Outbox.execute_with). A SELECT CTE that
# nothing references never runs, but a data-modifying CTE runs exactly once, to the end,
# whatever the main statement does: so the messages are emitted by the filter of an
# INSERT into the outbox table that inserts nothing (the message's LSN is never NULL),
# evaluated once per event. The table must exist (nothing is written to it: no row, no
# index entry, no WAL of its own); the NOTIFY, if asked for, is a second such CTE.
ATTACHED_ONE = (
    "outboxkit_events AS (INSERT INTO {table} (payload) SELECT NULL"
    " WHERE pg_logical_emit_message(true, {prefix}, %s::bytea) IS NULL)"
)
ATTACHED_MANY = (
    "outboxkit_events AS (INSERT INTO {table} (payload) SELECT NULL FROM unnest(%s::bytea[]) AS e"
    " WHERE pg_logical_emit_message(true, {prefix}, e) IS NULL)"
)
ATTACHED_NOTIFY = (
    ", outboxkit_notify AS (INSERT INTO {table} (payload) SELECT NULL"
    " WHERE pg_notify(%s, '') IS NULL)"
)


def message_prefix(table: str) -> str:
    """The logical message prefix of the outbox ``table`` (its name as the Outbox got it)."""
    return PREFIX + table


class WalStatements(NamedStatements):
    """The WAL write's statements of one outbox, its prefix rendered in as a literal."""

    emit_one = SqlTemplate(EMIT_ONE)
    emit_many = SqlTemplate(EMIT_MANY)
    emit_one_notify = SqlTemplate(NOTIFY_ONE)
    emit_many_notify = SqlTemplate(NOTIFY_MANY)
    attached_one = SqlTemplate(ATTACHED_ONE)
    attached_many = SqlTemplate(ATTACHED_MANY)
    attached_one_notify = SqlTemplate(ATTACHED_ONE + ATTACHED_NOTIFY)
    attached_many_notify = SqlTemplate(ATTACHED_MANY + ATTACHED_NOTIFY)

    def __init__(self, table: str) -> None:
        schema, name = parse_table(table)  # a plain name: the prefix is safe as a literal
        self.table = table
        self.prefix = message_prefix(table)
        self.channel = channel_for(table)
        self._render(
            {"prefix": sql.Literal(self.prefix).as_string(None), "table": quote_table(schema, name)}
        )
