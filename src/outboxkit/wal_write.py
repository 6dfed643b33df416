"""``Outbox(storage="wal")``: each event is a transactional logical message, not a row.

The outbox chooses this object in ``__init__``; its ``put``/``aput`` families send the
statement and parameters built here through the same driver adapters (so the same
refusals outside a transaction), and ``transaction()`` emits the messages in its COMMIT's
pipeline (``outboxkit.commit``). The statements live in ``store.wal_sql``, the envelope
format in ``outboxkit.wal_envelope``.

``execute_with`` cannot ride in the caller's statement as the table mode's INSERT does:
only a data-modifying CTE is sure to run, and a ``SELECT pg_logical_emit_message(...)``
CTE nobody references is never executed. So with psycopg the messages go in the same
pipeline as the caller's statement, just ahead of it (one round trip, one Sync: if the
caller's statement fails, the transaction has failed and the messages roll back with
it). asyncpg has no pipeline API: there they are one statement of their own first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import Any

import psycopg

from outboxkit.drivers import Statement, asyncpg_adapter, psycopg_adapter, type_name
from outboxkit.events import Event
from outboxkit.limits import MAX_BATCH_EVENTS, too_many_events
from outboxkit.store.postgres import numbered
from outboxkit.store.wal_sql import WalStatements
from outboxkit.wal_envelope import encode_envelope

_Check = Callable[[object], Event]
_Prepared = tuple[Statement, list[Any]]


def _statement(text: str) -> Statement:
    return Statement(text, numbered(text))


class WalWrite:
    """The statements and parameters of one WAL outbox's writes."""

    __slots__ = ("_many", "_one", "channel", "notify", "sql")

    def __init__(self, table: str, *, notify: bool) -> None:
        self.sql = sql = WalStatements(table)
        self.notify = notify
        self.channel = sql.channel
        if notify:
            self._one = _statement(sql.emit_one_notify)
            self._many = _statement(sql.emit_many_notify)
        else:
            self._one = _statement(sql.emit_one)
            self._many = _statement(sql.emit_many)

    @property
    def prefix(self) -> str:
        return self.sql.prefix

    def one(self, event: Event) -> _Prepared:
        """The statement and parameters that emit the checked ``event``."""
        if self.notify:
            return self._one, [encode_envelope(event), self.channel]
        return self._one, [encode_envelope(event)]

    def many(self, events: Iterable[Event], check: _Check) -> _Prepared | None:
        """One statement for ``events`` (each checked; at most a batch), None for none."""
        envelopes = [encode_envelope(check(e)) for e in islice(events, MAX_BATCH_EVENTS + 1)]
        if len(envelopes) > MAX_BATCH_EVENTS:
            raise too_many_events()
        if not envelopes:
            return None
        if len(envelopes) == 1:  # the cheaper statement: no array to build and unnest
            return self._one, [envelopes[0], self.channel] if self.notify else envelopes
        if self.notify:
            return self._many, [self.channel, envelopes]  # NOTIFY_MANY's order
        return self._many, [envelopes]

    # -- execute_with ---------------------------------------------------------------

    def execute_with(
        self,
        conn: psycopg.Connection[Any],
        query: str,
        params: Sequence[Any],
        events: Iterable[Event],
        check: _Check,
    ) -> psycopg.Cursor[Any]:
        emit = self._attached(query, params, events, check)
        psycopg_adapter.check_in_transaction(conn)
        if emit is None:
            return conn.execute(query, params)
        with conn.pipeline():
            conn.execute(emit[0].text, emit[1])
            cursor = conn.execute(query, params)
        return cursor

    async def aexecute_with(
        self,
        conn: Any,
        query: str,
        params: Sequence[Any],
        events: Iterable[Event],
        check: _Check,
    ) -> Any:
        """psycopg ``AsyncConnection`` (the cursor) or asyncpg (the rows); else None."""
        if isinstance(conn, psycopg.AsyncConnection):
            emit = self._attached(query, params, events, check)
            psycopg_adapter.check_in_transaction(conn)
            if emit is None:
                return await conn.execute(query, params)
            async with conn.pipeline():
                await conn.execute(emit[0].text, emit[1])
                cursor = await conn.execute(query, params)
            return cursor
        if asyncpg_adapter.Asyncpg.handles(type(conn)):
            emit = self._attached(query, params, events, check)
            asyncpg_adapter.check_in_transaction(conn)
            if emit is not None:
                await conn.execute(emit[0].dollar, *emit[1])
            return await conn.fetch(query, *params)
        return None

    def _attached(
        self, query: str, params: Sequence[Any], events: Iterable[Event], check: _Check
    ) -> _Prepared | None:
        # The table mode's checks, so that a query runs the same under either storage.
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type_name(query)}")
        if isinstance(params, Mapping):
            raise TypeError(
                "execute_with takes positional %s parameters (a sequence), not a mapping:"
                " the events' parameters are positional too"
            )
        return self.many(events, check)
