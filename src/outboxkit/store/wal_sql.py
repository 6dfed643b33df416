"""The WAL write's statements (``Outbox(storage="wal")``): one logical message per event.

``pg_logical_emit_message(true, prefix, envelope)`` writes a transactional message
into the WAL: logical decoding hands it over with its transaction's commit, and never
if the transaction rolls back. No heap row, no index entry, nothing to vacuum. It needs
no outbox table and works at any ``wal_level``; only a decoder (the CDC relay's slot)
needs ``wal_level = logical``. The prefix names the outbox, so one slot can carry several.
"""

from __future__ import annotations

from psycopg import sql

from outboxkit.store.postgres import NamedStatements, SqlTemplate, channel_for, parse_table

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


def message_prefix(table: str) -> str:
    """The logical message prefix of the outbox ``table`` (its name as the Outbox got it)."""
    return PREFIX + table


class WalStatements(NamedStatements):
    """The WAL write's statements of one outbox, its prefix rendered in as a literal."""

    emit_one = SqlTemplate(EMIT_ONE)
    emit_many = SqlTemplate(EMIT_MANY)
    emit_one_notify = SqlTemplate(NOTIFY_ONE)
    emit_many_notify = SqlTemplate(NOTIFY_MANY)

    def __init__(self, table: str) -> None:
        parse_table(table)  # a plain name: the prefix is safe as a literal, and matches the table's
        self.table = table
        self.prefix = message_prefix(table)
        self.channel = channel_for(table)
        self._render({"prefix": sql.Literal(self.prefix).as_string(None)})
