"""``Outbox(storage="wal")``: each event is a transactional logical message, not a row.

The same write paths as the table storage (``outboxkit.write.table``), through the same
driver adapters and refusals; the statements live in ``store.wal_sql``, the envelope
format in ``outboxkit.write.wal_envelope``. ``transaction()`` emits the messages in its
COMMIT's pipeline, a prepared statement per event.

``execute_with`` rides in the caller's statement as a data-modifying CTE, as in the
table mode: a ``SELECT pg_logical_emit_message(...)`` CTE that nothing references would
never run, so the messages are emitted by the filter of an INSERT that inserts nothing
(``store.wal_sql``, ``ATTACHED_ONE``): exactly once, with no round trip of its own. It
names the outbox table, which must exist (migrated; nothing is written to it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from outboxkit.backends.postgres.postgres import numbered
from outboxkit.backends.postgres.wal_sql import WalStatements
from outboxkit.drivers import Statement
from outboxkit.events import Event
from outboxkit.write.storage import (
    OIDS,
    BinaryRow,
    Check,
    CommitStatement,
    Prepared,
    Send,
    commit_statement,
    encode_batch,
)
from outboxkit.write.wal_envelope import encode_envelope


def _statement(text: str) -> Statement:
    return Statement(text, numbered(text))


class WalStorage:
    """The statements and parameters of one WAL outbox's writes."""

    __slots__ = ("_emits", "_many", "_one", "channel", "notify", "sql", "table")

    def __init__(self, table: str, *, notify: bool) -> None:
        self.table = table
        self.sql = sql = WalStatements(table)
        self.notify = notify
        self.channel = sql.channel
        if notify:
            self._one = _statement(sql.emit_one_notify)
            self._many = _statement(sql.emit_many_notify)
        else:
            self._one = _statement(sql.emit_one)
            self._many = _statement(sql.emit_many)
        # transaction(): the one parameter is the envelope (bytea), then the NOTIFY channel.
        bytea, text = OIDS["bytea"], OIDS["text"]
        self._emits = {
            notifies: commit_statement(
                numbered(stmt), [bytea, text] if notifies else [bytea], b"outboxkit_emit"
            )
            for notifies, stmt in ((False, sql.emit_one), (True, sql.emit_one_notify))
        }

    # -- put, put_many, execute_with --------------------------------------------------

    def one(self, event: Event) -> Prepared:
        if self.notify:
            return self._one, [encode_envelope(event), self.channel]
        return self._one, [encode_envelope(event)]

    def many(self, events: Iterable[Event], check: Check) -> Prepared | None:
        envelopes = encode_batch(events, check, encode_envelope)
        if not envelopes:
            return None
        if len(envelopes) == 1:  # the cheaper statement: no array to build and unnest
            return self._one, [envelopes[0], self.channel] if self.notify else envelopes
        if self.notify:
            return self._many, [self.channel, envelopes]  # NOTIFY_MANY's order
        return self._many, [envelopes]

    def attached(self, events: Iterable[Event], check: Check) -> tuple[str, list[Any]] | None:
        envelopes = encode_batch(events, check, encode_envelope)
        if not envelopes:
            return None
        sql = self.sql
        one = len(envelopes) == 1
        params: list[Any] = envelopes if one else [envelopes]
        if self.notify:
            params.append(self.channel)
            return (sql.attached_one_notify if one else sql.attached_many_notify), params
        return (sql.attached_one if one else sql.attached_many), params

    # -- transaction() ----------------------------------------------------------------

    def encode(self, event: Event) -> BinaryRow:
        return [encode_envelope(event)]

    def commit_inserts(self, rows: list[BinaryRow], send: Send) -> None:
        # One logical message per event; the NOTIFY (if asked for) rides on the first.
        start = 0
        if self.notify:
            send(self._emits[True], [*rows[0], self.channel.encode()])
            start = 1
        emit = self._emits[False]
        for row in rows[start:]:
            send(emit, row)

    def prepared(self) -> list[CommitStatement]:
        return list(self._emits.values())
