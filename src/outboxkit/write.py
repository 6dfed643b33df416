"""The atomic write: ``Outbox.put`` appends events inside the caller's open transaction.

The driver adapters (``outboxkit.drivers``) refuse to run where the write could not
be atomic with the business change (autocommit connection, a pool, a session with
no transaction begun), because that is the dual-write problem again. The events
written with the COMMIT (``Outbox.transaction()``) live in ``outboxkit.commit``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import orjson
import psycopg

from outboxkit.commit import AsyncOutboxTransaction, CommitInserts, OutboxTransaction
from outboxkit.drivers import (
    AsyncConnection,
    CursorCache,
    Statement,
    SyncConnection,
    Use,
    async_adapter,
    asyncpg_adapter,
    psycopg_adapter,
    sync_adapter,
    type_name,
)
from outboxkit.errors import InvalidEventError, outbox_table_missing
from outboxkit.events import DEFAULT_MAX_PAYLOAD_BYTES, Event
from outboxkit.limits import (
    DEFAULT_MAX_KEY_BYTES,
    MAX_BATCH_EVENTS,
    MAX_KEY_BYTES,
    too_many_events,
)
from outboxkit.store.postgres import Statements, numbered

if TYPE_CHECKING:
    import asyncpg

_EMPTY_HEADERS = "{}"
# A caller's statement that has its own WITH list: the events join that list.
_LEADING_WITH = re.compile(r"\s*WITH(\s+RECURSIVE)?\s+", re.IGNORECASE)
_DOLLAR_PARAM = re.compile(r"\$(\d+)")
_WRITE = Use(
    action="write an outbox event",
    inside="write inside its transaction",
    sync_methods="put()/put_many()",
    async_methods="`await aput()`/`aput_many()`",
)
# One event's values in store.postgres.WRITE_COLUMNS order (tests/unit/test_outbox_columns.py).
_Row = tuple[Any, str, str | None, str, str | None, str | None, bytes, str, Any, str | None]


def _row(event: Event) -> _Row:
    headers = orjson.dumps(event.headers).decode() if event.headers else _EMPTY_HEADERS
    return (
        event.event_id,
        event.topic,
        event.key,
        event.event_type,
        event.aggregate_type,
        event.aggregate_id,
        event.payload,
        headers,
        event.occurred_at,
        event.schema_version,
    )


class Outbox:
    """Writes events into one outbox table, atomically with the caller's transaction.

    ``notify`` sends one ``NOTIFY`` per transaction (PostgreSQL delivers it on
    commit and folds repeats) so an idle relay wakes at once; turn it off to
    save its commit-time cost and rely on the relay's polling.

    ``max_payload_bytes`` (1 MiB) and ``max_key_bytes`` (1 KiB, at most 64 KiB) bound
    what one event may carry; the other fields have fixed limits (``outboxkit.limits``).
    ``put_many`` takes at most 10 000 events per call.
    """

    def __init__(
        self,
        table: str = "outbox",
        *,
        notify: bool = True,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
    ) -> None:
        if max_payload_bytes <= 0:
            raise ValueError("max_payload_bytes must be positive")
        if not 0 < max_key_bytes <= MAX_KEY_BYTES:
            raise ValueError(f"max_key_bytes must be between 1 and {MAX_KEY_BYTES}")
        self.table = table
        self.notify = notify
        self.max_payload_bytes = max_payload_bytes
        self.max_key_bytes = max_key_bytes
        self._sql = Statements(table)
        if notify:
            self._one, self._many = self._sql.insert_one_notify, self._sql.insert_many_notify
        else:
            self._one, self._many = self._sql.insert_one, self._sql.insert_many
        self._one_stmt = Statement(self._one, numbered(self._one))
        self._many_stmt = Statement(self._many, numbered(self._many))
        self._commit = CommitInserts(self._sql, notify=notify, check=self._check)
        # One reusable psycopg cursor per Outbox and API, for the connection it last
        # wrote through (see CursorCache).
        self._sync_cursor = CursorCache()
        self._async_cursor = CursorCache()

    def __repr__(self) -> str:
        return f"Outbox(table={self.table!r}, notify={self.notify})"

    # -- validation and parameters --------------------------------------------

    def _check(self, event: object) -> Event:
        if not isinstance(event, Event):
            raise InvalidEventError(f"expected an outboxkit.Event, got {type_name(event)}")
        event.check_size(self.max_payload_bytes, self.max_key_bytes)
        return event

    def _check_all(self, events: Iterable[Event]) -> list[_Row]:
        """The rows of ``events``, every one checked; refuses more than a batch's worth."""
        rows = [_row(self._check(e)) for e in itertools.islice(events, MAX_BATCH_EVENTS + 1)]
        if len(rows) > MAX_BATCH_EVENTS:
            raise too_many_events()
        return rows

    def _params_one(self, event: object) -> list[Any]:
        params: list[Any] = list(_row(self._check(event)))
        if self.notify:
            params.append(self._sql.channel)
        return params

    def _params_many(self, events: Iterable[Event]) -> list[Any] | None:
        rows = self._check_all(events)
        if not rows:
            return None
        params: list[Any] = [list(column) for column in zip(*rows, strict=True)]
        if self.notify:
            params.append(self._sql.channel)
        return params

    # -- sync -----------------------------------------------------------------

    def put(self, conn: SyncConnection, event: Event) -> None:
        """Append ``event`` in ``conn``'s open transaction (psycopg or SQLAlchemy)."""
        params = self._params_one(event)
        try:
            sync_adapter(conn, _WRITE).execute(conn, self._one_stmt, params, self._sync_cursor)
        except Exception as exc:
            if (missing := outbox_table_missing(exc, self.table)) is not None:
                raise missing from exc
            raise

    def put_many(self, conn: SyncConnection, events: Iterable[Event]) -> None:
        """Append ``events`` (at most 10 000) in one statement and one round trip."""
        params = self._params_many(events)
        if params is None:
            return
        try:
            adapter = sync_adapter(conn, _WRITE)
            adapter.execute(conn, self._many_stmt, params, self._sync_cursor)
        except Exception as exc:
            if (missing := outbox_table_missing(exc, self.table)) is not None:
                raise missing from exc
            raise

    # -- events written with the COMMIT ------------------------------------------

    def transaction(self, conn: psycopg.Connection[Any]) -> OutboxTransaction:
        """A transaction whose events are written in the COMMIT's round trip (psycopg).

        Use it instead of ``with conn.transaction():``; ``tx.put(event)`` validates
        and queues, and at the end of the block the events' INSERTs and the COMMIT
        go to the server as one pipeline: the cheapest write of this library
        (docs/benchmarks.md). An exception in the block rolls back and sends nothing.
        The INSERT is a prepared statement unless ``conn.prepare_threshold`` is None::

            with outbox.transaction(conn) as tx:
                conn.execute("INSERT INTO orders ...")
                tx.put(Event(topic="orders", event_type="order.placed", payload=...))
        """
        return OutboxTransaction(self._commit, conn)

    def atransaction(self, conn: psycopg.AsyncConnection[Any]) -> AsyncOutboxTransaction:
        """:meth:`transaction` for psycopg ``AsyncConnection``: ``async with``."""
        return AsyncOutboxTransaction(self._commit, conn)

    # -- events in the caller's own statement -----------------------------------

    def execute_with(
        self,
        conn: psycopg.Connection[Any],
        query: str,
        params: Sequence[Any] = (),
        *,
        events: Iterable[Event],
    ) -> psycopg.Cursor[Any]:
        """Run your ``query`` and append ``events`` in that same statement.

        The events ride in front of ``query`` (an INSERT, UPDATE, DELETE or
        SELECT with positional ``%s`` parameters) as a data-modifying CTE: no
        statement and no round trip of their own, about half the cost of
        :meth:`put` (docs/benchmarks.md). They are written once whatever
        ``query`` matches, and commit or roll back with the transaction, like
        :meth:`put`. Returns the cursor, for ``RETURNING`` rows. psycopg; see
        :meth:`aexecute_with` for psycopg async and asyncpg.
        """
        if not isinstance(conn, psycopg.Connection):
            raise _unsupported_attach(conn, "execute_with", "psycopg.Connection")
        stmt, all_params = self._attached(query, params, events)
        psycopg_adapter.check_in_transaction(conn)
        try:
            return conn.execute(stmt, all_params)
        except Exception as exc:
            missing = outbox_table_missing(exc, self.table, with_callers_sql=True)
            if missing is not None:
                raise missing from exc
            raise

    @overload
    async def aexecute_with(
        self,
        conn: psycopg.AsyncConnection[Any],
        query: str,
        params: Sequence[Any] = (),
        *,
        events: Iterable[Event],
    ) -> psycopg.AsyncCursor[Any]: ...

    @overload
    async def aexecute_with(
        self,
        conn: asyncpg.Connection,
        query: str,
        params: Sequence[Any] = (),
        *,
        events: Iterable[Event],
    ) -> list[asyncpg.Record]: ...

    async def aexecute_with(
        self,
        conn: Any,
        query: str,
        params: Sequence[Any] = (),
        *,
        events: Iterable[Event],
    ) -> Any:
        """Async :meth:`execute_with`: psycopg ``AsyncConnection`` or asyncpg ``Connection``.

        With psycopg, ``query`` uses ``%s`` and the cursor is returned; with
        asyncpg, ``query`` uses ``$1 … $n`` and the rows (``conn.fetch``) are
        returned, an empty list for a statement without ``RETURNING``.
        """
        try:
            if isinstance(conn, psycopg.AsyncConnection):
                stmt, all_params = self._attached(query, params, events)
                psycopg_adapter.check_in_transaction(conn)
                return await conn.execute(stmt, all_params)
            if asyncpg_adapter.Asyncpg.handles(type(conn)):
                stmt, all_params = self._attached(query, params, events, dollar=True)
                asyncpg_adapter.check_in_transaction(conn)
                return await conn.fetch(stmt, *all_params)
        except Exception as exc:
            missing = outbox_table_missing(exc, self.table, with_callers_sql=True)
            if missing is not None:
                raise missing from exc
            raise
        raise _unsupported_attach(
            conn, "aexecute_with", "psycopg.AsyncConnection or asyncpg.Connection"
        )

    def _attached(
        self, query: str, params: Sequence[Any], events: Iterable[Event], *, dollar: bool = False
    ) -> tuple[str, list[Any]]:
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type_name(query)}")
        if isinstance(params, Mapping):
            raise TypeError(
                "execute_with takes positional %s parameters (a sequence), not a mapping:"
                " the events' parameters are positional too"
            )
        rows = self._check_all(events)
        if not rows:
            return query, list(params)
        sql = self._sql
        if len(rows) == 1:
            cte = sql.attached_one_notify if self.notify else sql.attached_one
            event_params: list[Any] = list(rows[0])
        else:
            cte = sql.attached_many_notify if self.notify else sql.attached_many
            event_params = [list(column) for column in zip(*rows, strict=True)]
        if self.notify:
            event_params.append(sql.channel)
        if dollar:
            # $n parameters: the caller's keep their numbers, the events' follow them.
            taken = max((int(n) for n in _DOLLAR_PARAM.findall(query)), default=0)
            cte = numbered(cte, start=taken + 1)
            all_params = [*params, *event_params]
        else:
            # %s parameters: the events' CTE comes first in the text, so theirs do too.
            all_params = [*event_params, *params]
        leading = _LEADING_WITH.match(query)
        if leading:
            stmt = f"{query[: leading.end()]}{cte},\n{query[leading.end() :]}"
        else:
            stmt = f"WITH {cte}\n{query}"
        return stmt, all_params

    # -- async ----------------------------------------------------------------

    async def aput(self, conn: AsyncConnection, event: Event) -> None:
        """Async :meth:`put`: psycopg ``AsyncConnection``, asyncpg, SQLAlchemy async."""
        params = self._params_one(event)
        try:
            adapter = async_adapter(conn, _WRITE)
            await adapter.execute(conn, self._one_stmt, params, self._async_cursor)
        except Exception as exc:
            if (missing := outbox_table_missing(exc, self.table)) is not None:
                raise missing from exc
            raise

    async def aput_many(self, conn: AsyncConnection, events: Iterable[Event]) -> None:
        """Async :meth:`put_many`."""
        params = self._params_many(events)
        if params is None:
            return
        try:
            adapter = async_adapter(conn, _WRITE)
            await adapter.execute(conn, self._many_stmt, params, self._async_cursor)
        except Exception as exc:
            if (missing := outbox_table_missing(exc, self.table)) is not None:
                raise missing from exc
            raise


def _unsupported_attach(conn: Any, method: str, expected: str) -> Exception:
    return TypeError(
        f"{method}() needs a {expected}, got {type_name(conn)};"
        " with other drivers write the events with put()/aput()"
    )
