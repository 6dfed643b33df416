"""The atomic write: ``Outbox.put`` appends events inside the caller's open transaction.

The driver adapters (``outboxkit.drivers``) refuse to run where the write could not
be atomic with the business change (autocommit connection, a pool, a session with
no transaction begun), because that is the dual-write problem again. The events
written with the COMMIT (``Outbox.transaction()``) live in ``outboxkit.write.commit``.
"""

from __future__ import annotations

import datetime as dt
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import orjson
import psycopg

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
from outboxkit.errors import ConfigurationError, InvalidEventError, outbox_table_missing
from outboxkit.events import DEFAULT_MAX_PAYLOAD_BYTES, Event
from outboxkit.limits import (
    DEFAULT_MAX_KEY_BYTES,
    MAX_BATCH_EVENTS,
    MAX_KEY_BYTES,
    too_many_events,
)
from outboxkit.store.postgres import WRITE_COLUMNS, Statements, numbered
from outboxkit.write.commit import AsyncOutboxTransaction, CommitInserts, OutboxTransaction
from outboxkit.write.wal import WalWrite

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
_Row = tuple[Any, str, str | None, str, str | None, str | None, bytes, str, Any, str | None, Any]
_KEY = [name for name, _ in WRITE_COLUMNS].index("key")
_AVAILABLE_AT = [name for name, _ in WRITE_COLUMNS].index("available_at")


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
        event.available_at,
    )


def any_due(available_at: Iterable[Any]) -> bool:
    """Whether any of the events is due now: only then is a NOTIFY worth sending.

    A scheduled event (``deliver_at``/``delay``) in the future would wake the relays
    for nothing; their poll finds it within ``poll_interval`` of its time.
    """
    now: dt.datetime | None = None
    for at in available_at:
        if at is None:
            return True
        if now is None:
            now = dt.datetime.now(dt.UTC)
        if at <= now:
            return True
    return False


def ordered_keys(keys: Iterable[Any]) -> list[str] | None:
    """The distinct keys whose advisory locks an ordered write takes, or None (keyless).

    The SQL (store.postgres.KEY_LOCKS) locks them in hash order, whatever order they
    come in here, so two writers can never wait for each other in a cycle.
    """
    distinct = {k for k in keys if k is not None}
    return list(distinct) if distinct else None


class Outbox:
    """Writes events into one outbox table, atomically with the caller's transaction.

    ``notify`` sends one ``NOTIFY`` per transaction (PostgreSQL delivers it on
    commit and folds repeats) so an idle relay wakes at once; turn it off to
    save its commit-time cost and rely on the relay's polling.

    ``max_payload_bytes`` (1 MiB) and ``max_key_bytes`` (1 KiB, at most 64 KiB) bound
    what one event may carry; the other fields have fixed limits (``outboxkit.limits``).
    ``put_many`` takes at most 10 000 events per call.

    ``ordered=True`` makes commit order per key well defined for an ordered relay: a
    write of keyed events first takes a transaction-scoped advisory lock per distinct
    key, in the same statement and before its rows take their ids, held until the
    transaction ends. A second transaction writing one of those keys waits there, so
    for each key the ids follow the commit order (without it, two writers can take
    ids n and n + 1 and commit n + 1 first: a relay would publish them out of order).
    Every writer of the table must use it. The cost: writers of one key serialise
    from their first write of it to COMMIT (``transaction()`` holds it only for the
    COMMIT's round trip); keyless events take no lock. Within one ``put_many``/
    ``transaction()`` the locks are taken in a fixed order; across several ``put()``
    calls of one transaction they follow the calls, so two transactions putting keys
    a, b and b, a may deadlock (PostgreSQL aborts one: retry it, as with row locks).
    The locks share the server's lock table (``max_locks_per_transaction`` times
    ``max_connections`` entries for all sessions): a transaction of over ten thousand
    distinct keys can fail with "out of shared memory" (nothing is written; raise
    ``max_locks_per_transaction`` or split the write). docs/architecture.md
    ("Ordered writes") says why an advisory lock.

    ``storage="wal"`` writes no row: each event becomes one transactional logical
    message (``pg_logical_emit_message``, prefix ``outboxkit:<table>``) carrying it in a
    binary envelope (``outboxkit.write.wal_envelope``), for the CDC relay (``Relay(...,
    source="cdc")``) to read from a replication slot in commit order. Same API, checks
    and refusals; no outbox table is written, no index or vacuum cost. ``notify``
    defaults to False there (the stream needs no wake-up); ``ordered`` is refused (the
    stream is in commit order already). README "Relaying from the WAL".
    """

    def __init__(
        self,
        table: str = "outbox",
        *,
        notify: bool | None = None,
        ordered: bool = False,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_key_bytes: int = DEFAULT_MAX_KEY_BYTES,
        storage: str = "table",
    ) -> None:
        if storage not in ("table", "wal"):
            raise ConfigurationError(
                f"storage must be 'table' (a row per event, any relay) or 'wal' (a logical"
                f" message per event, for the CDC relay), got {storage!r}"
            )
        if storage == "wal" and ordered:
            raise ConfigurationError(
                "Outbox(storage='wal') cannot take ordered=True: the WAL relay publishes in"
                " commit order already; ordered=True is for the table's polling relay"
            )
        if notify is None:  # a polling relay sleeps between polls; the CDC stream does not
            notify = storage == "table"
        if max_payload_bytes <= 0:
            raise ValueError("max_payload_bytes must be positive")
        if not 0 < max_key_bytes <= MAX_KEY_BYTES:
            raise ValueError(f"max_key_bytes must be between 1 and {MAX_KEY_BYTES}")
        self.table = table
        self.notify = notify
        self.ordered = ordered
        self.max_payload_bytes = max_payload_bytes
        self.max_key_bytes = max_key_bytes
        self.storage = storage
        # storage="wal": the WAL write's statements and parameters (outboxkit.write.wal).
        self._wal = WalWrite(table, notify=notify) if storage == "wal" else None
        self._sql = sql = Statements(table)
        # The statements by (locks keys, notifies): a scheduled event's write sends no
        # NOTIFY; only an ordered outbox's keyed write takes the key locks.
        one = {
            (False, False): sql.insert_one,
            (False, True): sql.insert_one_notify,
            (True, False): sql.insert_one_ordered,
            (True, True): sql.insert_one_ordered_notify,
        }
        many = {
            (False, False): sql.insert_many,
            (False, True): sql.insert_many_notify,
            (True, False): sql.insert_many_ordered,
            (True, True): sql.insert_many_ordered_notify,
        }
        self._one_stmts = {k: Statement(v, numbered(v)) for k, v in one.items()}
        self._many_stmts = {k: Statement(v, numbered(v)) for k, v in many.items()}
        self._attached_sql = {
            (False, False, False): sql.attached_one,
            (False, False, True): sql.attached_one_notify,
            (False, True, False): sql.attached_one_ordered,
            (False, True, True): sql.attached_one_ordered_notify,
            (True, False, False): sql.attached_many,
            (True, False, True): sql.attached_many_notify,
            (True, True, False): sql.attached_many_ordered,
            (True, True, True): sql.attached_many_ordered_notify,
        }
        self._commit = CommitInserts(
            sql,
            notify=notify,
            ordered=ordered,
            check=self._check,
            wal=self._wal.sql if self._wal is not None else None,
        )
        # One reusable psycopg cursor per Outbox and API, for the connection it last
        # wrote through (see CursorCache).
        self._sync_cursor = CursorCache()
        self._async_cursor = CursorCache()

    def __repr__(self) -> str:
        ordered = ", ordered=True" if self.ordered else ""
        wal = ", storage='wal'" if self._wal is not None else ""
        return f"Outbox(table={self.table!r}, notify={self.notify}{ordered}{wal})"

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

    def _params_one(self, event: object) -> tuple[Statement, list[Any]]:
        checked = self._check(event)
        if self._wal is not None:
            return self._wal.one(checked)
        params: list[Any] = list(_row(checked))
        locks = self.ordered and checked.key is not None
        if locks:
            params.append(checked.key)
        notify = self.notify and (checked.available_at is None or any_due([checked.available_at]))
        if notify:
            params.append(self._sql.channel)
        return self._one_stmts[locks, notify], params

    def _params_many(self, events: Iterable[Event]) -> tuple[Statement, list[Any]] | None:
        if self._wal is not None:
            return self._wal.many(events, self._check)
        rows = self._check_all(events)
        if not rows:
            return None
        params: list[Any] = [list(column) for column in zip(*rows, strict=True)]
        keys = ordered_keys(params[_KEY]) if self.ordered else None
        if keys is not None:
            params.append(keys)
        notify = self.notify and any_due(params[_AVAILABLE_AT])
        if notify:
            params.append(self._sql.channel)
        return self._many_stmts[keys is not None, notify], params

    # -- sync -----------------------------------------------------------------

    def put(self, conn: SyncConnection, event: Event) -> None:
        """Append ``event`` in ``conn``'s open transaction (psycopg or SQLAlchemy)."""
        stmt, params = self._params_one(event)
        try:
            sync_adapter(conn, _WRITE).execute(conn, stmt, params, self._sync_cursor)
        except Exception as exc:
            if (missing := outbox_table_missing(exc, self.table)) is not None:
                raise missing from exc
            raise

    def put_many(self, conn: SyncConnection, events: Iterable[Event]) -> None:
        """Append ``events`` (at most 10 000) in one statement and one round trip."""
        prepared = self._params_many(events)
        if prepared is None:
            return
        try:
            adapter = sync_adapter(conn, _WRITE)
            adapter.execute(conn, *prepared, self._sync_cursor)
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
        if self._wal is not None:  # storage="wal": see outboxkit.write.wal
            wal = self._wal.attached(events, self._check)
            return (query, list(params)) if wal is None else _attach(query, params, *wal, dollar)
        rows = self._check_all(events)
        if not rows:
            return query, list(params)
        many = len(rows) > 1
        if many:
            event_params: list[Any] = [list(column) for column in zip(*rows, strict=True)]
        else:
            event_params = list(rows[0])
        keys = ordered_keys(row[_KEY] for row in rows) if self.ordered else None
        if keys is not None:
            event_params.append(keys if many else keys[0])  # one event: KEY_LOCK, a text
        notify = self.notify and any_due(row[_AVAILABLE_AT] for row in rows)
        if notify:
            event_params.append(self._sql.channel)
        cte = self._attached_sql[many, keys is not None, notify]
        return _attach(query, params, cte, event_params, dollar)

    # -- async ----------------------------------------------------------------

    async def aput(self, conn: AsyncConnection, event: Event) -> None:
        """Async :meth:`put`: psycopg ``AsyncConnection``, asyncpg, SQLAlchemy async."""
        stmt, params = self._params_one(event)
        try:
            adapter = async_adapter(conn, _WRITE)
            await adapter.execute(conn, stmt, params, self._async_cursor)
        except Exception as exc:
            if (missing := outbox_table_missing(exc, self.table)) is not None:
                raise missing from exc
            raise

    async def aput_many(self, conn: AsyncConnection, events: Iterable[Event]) -> None:
        """Async :meth:`put_many`."""
        prepared = self._params_many(events)
        if prepared is None:
            return
        try:
            adapter = async_adapter(conn, _WRITE)
            await adapter.execute(conn, *prepared, self._async_cursor)
        except Exception as exc:
            if (missing := outbox_table_missing(exc, self.table)) is not None:
                raise missing from exc
            raise


def _attach(
    query: str, params: Sequence[Any], cte: str, event_params: list[Any], dollar: bool
) -> tuple[str, list[Any]]:
    """``query`` with the events' ``cte`` in front of it (joining its own WITH list)."""
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


def _unsupported_attach(conn: Any, method: str, expected: str) -> Exception:
    return TypeError(
        f"{method}() needs a {expected}, got {type_name(conn)};"
        " with other drivers write the events with put()/aput()"
    )
