"""The atomic write: ``Outbox.put`` appends events inside the caller's open transaction.

The driver adapters (``outboxkit.drivers``) refuse to run where the write could not
be atomic with the business change (autocommit connection, a pool, a session with
no transaction begun), because that is the dual-write problem again. The outbox
checks each event and runs what its storage (``write.table`` or ``write.wal``, chosen
once, at construction) makes of it; the events written with the COMMIT
(``Outbox.transaction()``) go through ``write.commit``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

import psycopg

from outboxkit.backends import Backend, backend_for, backend_of
from outboxkit.backends.postgres.postgres import numbered
from outboxkit.drivers import (
    AsyncConnection,
    CursorCache,
    SyncConnection,
    Use,
    async_adapter,
    asyncpg_adapter,
    psycopg_adapter,
    sync_adapter,
    type_name,
)
from outboxkit.drivers.base import raw_async_adapter, raw_sync_adapter
from outboxkit.drivers.dbapi_adapter import DBAPIAsync, DBAPISync
from outboxkit.errors import (
    ConfigurationError,
    InvalidEventError,
    outbox_table_missing,
    transaction_conflict,
    wrong_backend,
)
from outboxkit.events import DEFAULT_MAX_PAYLOAD_BYTES, Event
from outboxkit.limits import DEFAULT_MAX_KEY_BYTES, MAX_KEY_BYTES
from outboxkit.write import deferred
from outboxkit.write.commit import AsyncOutboxTransaction, OutboxTransaction
from outboxkit.write.mariadb_commit import (
    AsyncMariaDBTransaction,
    MariaDBTransaction,
    MySQLConnection,
    unsupported,
)
from outboxkit.write.mariadb_table import MariaDBTableStorage
from outboxkit.write.storage import PipelinedStorage, Storage
from outboxkit.write.table import TableStorage
from outboxkit.write.wal import WalStorage

if TYPE_CHECKING:
    import asyncpg
    import sqlalchemy.engine
    import sqlalchemy.ext.asyncio
    import sqlalchemy.orm

# A caller's statement that has its own WITH list: the events join that list.
_LEADING_WITH = re.compile(r"\s*WITH(\s+RECURSIVE)?\s+", re.IGNORECASE)
_DOLLAR_PARAM = re.compile(r"\$(\d+)")
_WRITE = Use(
    action="write an outbox event",
    inside="write inside its transaction",
    sync_methods="put()/put_many()",
    async_methods="`await aput()`/`aput_many()`",
)


class _SchemaErrors:
    """Every write path's one translation of the driver's error for a missing (or not
    yet migrated) outbox table, or a MariaDB deadlock or lock wait timeout, into
    outboxkit's, which says what to do.

    ``with_callers_sql``: the statement also ran the caller's SQL (``execute_with``), so
    only an error naming the outbox table counts. Stateless: one per outbox, shared by
    its threads and tasks.
    """

    __slots__ = ("storage", "table", "with_callers_sql")

    def __init__(self, table: str, *, with_callers_sql: bool, storage: str = "table") -> None:
        self.table = table
        self.with_callers_sql = with_callers_sql
        self.storage = storage

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, Exception):
            missing = outbox_table_missing(exc, self.table, with_callers_sql=self.with_callers_sql)
            if missing is not None:
                raise missing from exc
            wrong = wrong_backend(exc, self.storage)
            if wrong is not None:
                raise wrong from exc
            conflict = transaction_conflict(exc, rolled_back=False)  # MariaDB's 1213, 1205
            if conflict is not None:
                raise conflict from exc


class _Writer:
    """What one database's writes of an ``Outbox`` use: its storage and its errors."""

    __slots__ = ("errors", "storage")

    def __init__(self, storage: Storage, kind: str) -> None:
        self.storage = storage
        self.errors = _SchemaErrors(storage.table, with_callers_sql=False, storage=kind)


def _pg_table(table: str, notify: bool, ordered: bool) -> Storage:
    return TableStorage(table, notify=notify, ordered=ordered)


def _mariadb_table(table: str, notify: bool, ordered: bool) -> Storage:
    return MariaDBTableStorage(table, ordered=ordered)  # no NOTIFY: in-process wake-ups


#: ``storage="table"``'s storage per backend (``Backend.name``), built at the first write
#: through a connection of that database. ``Backend.name`` is the backend's whole hint; the
#: storages cannot be handed out by it: they build ``drivers.Statement``s of ``events.Event``s
#: (``drivers``, ``events`` and ``backends`` are one layer, whose modules do not import each
#: other), and a ``Backend`` naming a ``write`` class, even as a string imported late, would
#: be an upward import ``lint-imports`` cannot see. A third database adds one line here.
_TABLES: dict[str, Callable[[str, bool, bool], Storage]] = {
    "postgresql": _pg_table,
    "mariadb": _mariadb_table,
}


#: execute_with()'s database (a CTE in front of the caller's statement).
_POSTGRES = backend_for("postgresql://")


def _pipelined(storage: Storage) -> PipelinedStorage:
    """``storage`` as ``transaction()``'s pipeline asks it (PostgreSQL's table and WAL)."""
    assert isinstance(storage, (TableStorage, WalStorage))
    return storage


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

    ``default`` is orjson's hook for payload values it cannot write (your own types):
    it returns JSON types for them, or raises ``TypeError``. ``Event()`` already encodes
    datetimes, UUIDs, dataclasses, enums, ``Decimal`` (as a string) and pydantic models;
    a value neither knows fails the write with its path (``payload.items[2].price``).

    The default ``storage="table"`` writes a row of the outbox table of the database of
    the connection it is given: PostgreSQL's (psycopg, asyncpg, SQLAlchemy on them) or
    MariaDB/MySQL's (PyMySQL, mysqlclient, aiomysql, asyncmy, SQLAlchemy on them; no NOTIFY
    there: an idle relay of this process is woken instead). One ``Outbox`` may write both
    in one process; each database's storage is chosen at its first write and kept.
    ``storage="mariadb"`` fixes MariaDB/MySQL's whatever the connection.

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
        default: Callable[[Any], Any] | None = None,
    ) -> None:
        if storage not in ("table", "wal", "mariadb"):
            raise ConfigurationError(
                f"storage must be 'table' (a row per event in the outbox table of the"
                f" connection's database, any relay), 'wal' (a logical message per event, for"
                f" PostgreSQL's CDC relay) or 'mariadb' (a row of a MariaDB/MySQL outbox,"
                f" whatever the connection), got {storage!r}"
            )
        if storage == "wal" and ordered:
            raise ConfigurationError(
                "Outbox(storage='wal') cannot take ordered=True: the WAL relay publishes in"
                " commit order already; ordered=True is for the table's polling relay"
            )
        if storage == "mariadb" and notify:
            raise ConfigurationError(
                "Outbox(storage='mariadb') cannot take notify=True: MariaDB/MySQL has no"
                " LISTEN/NOTIFY (its relay polls; see --poll-interval)"
            )
        if max_payload_bytes <= 0:
            raise ValueError("max_payload_bytes must be positive")
        if not 0 < max_key_bytes <= MAX_KEY_BYTES:
            raise ValueError(f"max_key_bytes must be between 1 and {MAX_KEY_BYTES}")
        self.table = table
        #: Whether a write sends a NOTIFY (PostgreSQL's table: unless notify=False; the WAL
        #: and MariaDB/MySQL, which has none: no).
        self.notify = (storage == "table") if notify is None else notify
        self._notify_asked = notify
        self.ordered = ordered
        self.max_payload_bytes = max_payload_bytes
        self.max_key_bytes = max_key_bytes
        self.storage = storage
        #: Turns payload values JSON lacks (your own types) into JSON ones, as orjson's.
        self.default = default
        # storage="table" follows the connection: its database's writer is built at the first
        # write through a connection of that kind and kept (one per backend, _writer_of).
        # "wal" and "mariadb" are fixed here.
        self._writers: dict[Backend, _Writer] = {}
        self._fixed: _Writer | None = None
        if storage == "wal":
            self._fixed = _Writer(WalStorage(table, notify=self.notify), "wal")
        elif storage == "mariadb":
            self.notify = False
            self._fixed = _Writer(MariaDBTableStorage(table, ordered=ordered), "mariadb")
        self._attached_errors = _SchemaErrors(table, with_callers_sql=True)
        # One reusable psycopg cursor per Outbox and API, for the connection it last
        # wrote through (see CursorCache).
        self._sync_cursor = CursorCache()
        self._async_cursor = CursorCache()

    def __repr__(self) -> str:
        ordered = ", ordered=True" if self.ordered else ""
        wal = f", storage={self.storage!r}" if self.storage != "table" else ""
        return f"Outbox(table={self.table!r}, notify={self.notify}{ordered}{wal})"

    def _writer_of(self, conn: Any) -> _Writer:
        """The writer for ``conn``'s database (``storage="table"``: its backend's table)."""
        fixed = self._fixed
        if fixed is not None:
            return fixed
        writer = self._writers.get(backend_of(conn))
        return writer if writer is not None else self._writer_for(backend_of(conn))

    def _writer_for(self, backend: Backend) -> _Writer:
        """The writer for ``backend``'s database, built at its first use and kept."""
        writer = self._fixed or self._writers.get(backend)
        if writer is None:
            writer = self._writers[backend] = self._new_writer(backend)
        return writer

    def _new_writer(self, backend: Backend) -> _Writer:
        if not backend.can("notify"):
            if self._notify_asked:
                backend.refuse("notify")
            return _Writer(_TABLES[backend.name](self.table, False, self.ordered), backend.name)
        return _Writer(_TABLES[backend.name](self.table, self.notify, self.ordered), "table")

    # -- validation and parameters --------------------------------------------

    def _check(self, event: object) -> Event:
        if not isinstance(event, Event):
            raise InvalidEventError(f"expected an outboxkit.Event, got {type_name(event)}")
        if event.payload_pending:  # a value Event()'s encoder lacks: this default= may know it
            event.encode_payload(self.default)
        event.check_size(self.max_payload_bytes, self.max_key_bytes)
        return event

    # -- sync -----------------------------------------------------------------

    def put(self, conn: SyncConnection, event: Event) -> None:
        """Append ``event`` in ``conn``'s open transaction (psycopg or SQLAlchemy)."""
        writer = self._writer_of(conn)
        stmt, params = writer.storage.one(self._check(event))
        with writer.errors:
            sync_adapter(conn, _WRITE).execute(conn, stmt, params, self._sync_cursor)

    def put_many(self, conn: SyncConnection, events: Iterable[Event]) -> None:
        """Append ``events`` (at most 10 000) in one statement and one round trip."""
        writer = self._writer_of(conn)
        prepared = writer.storage.many(events, self._check)
        if prepared is None:
            return
        with writer.errors:
            sync_adapter(conn, _WRITE).execute(conn, *prepared, self._sync_cursor)

    # -- events written with the COMMIT ------------------------------------------

    @overload
    def transaction(self, conn: psycopg.Connection[Any]) -> OutboxTransaction: ...

    @overload
    def transaction(self, conn: MySQLConnection) -> MariaDBTransaction: ...

    def transaction(self, conn: Any) -> OutboxTransaction | MariaDBTransaction:
        """A transaction whose events are written in the COMMIT's round trip.

        Use it instead of ``with conn.transaction():``; ``tx.put(event)`` validates
        and queues, and at the end of the block the events' INSERTs and the COMMIT
        go to the server as one pipeline: the cheapest write of this library
        (docs/benchmarks.md). An exception in the block rolls back and sends nothing.
        The INSERT is a prepared statement unless ``conn.prepare_threshold`` is None::

            with outbox.transaction(conn) as tx:
                conn.execute("INSERT INTO orders ...")
                tx.put(Event(topic="orders", event_type="order.placed", payload=...))

        On MariaDB/MySQL: a PyMySQL or mysqlclient connection, instead of your own
        BEGIN/``commit()``; the INSERT and the COMMIT travel as one multi-statement query
        where the connection allows it (``write.mariadb_commit``), and an idle relay of this
        process is woken once it returned.
        """
        storage = self._writer_of(conn).storage
        if isinstance(storage, MariaDBTableStorage):
            adapter = raw_sync_adapter(conn)
            if not isinstance(adapter, DBAPISync) or adapter.backend != "mariadb":
                raise unsupported(conn, "transaction", "PyMySQL or mysqlclient")
            return MariaDBTransaction(storage, self._check, conn, adapter)
        return OutboxTransaction(_pipelined(storage), self._check, conn)

    @overload
    def atransaction(self, conn: psycopg.AsyncConnection[Any]) -> AsyncOutboxTransaction: ...

    @overload
    def atransaction(self, conn: MySQLConnection) -> AsyncMariaDBTransaction: ...

    def atransaction(self, conn: Any) -> AsyncOutboxTransaction | AsyncMariaDBTransaction:
        """:meth:`transaction` for psycopg ``AsyncConnection`` (aiomysql or asyncmy on
        MariaDB): ``async with``."""
        storage = self._writer_of(conn).storage
        if isinstance(storage, MariaDBTableStorage):
            adapter = raw_async_adapter(conn)
            if not isinstance(adapter, DBAPIAsync) or adapter.backend != "mariadb":
                raise unsupported(conn, "atransaction", "aiomysql or asyncmy")
            return AsyncMariaDBTransaction(storage, self._check, conn, adapter)
        return AsyncOutboxTransaction(_pipelined(storage), self._check, conn)

    # -- events queued in a SQLAlchemy session, written with its COMMIT -----------

    def defer(
        self, conn: sqlalchemy.orm.Session | sqlalchemy.engine.Connection, event: Event
    ) -> None:
        """Queue ``event`` in ``conn``'s open transaction; it is written with its COMMIT.

        For SQLAlchemy, whose Session owns the COMMIT: the event is checked now, and
        on psycopg its INSERT travels with the COMMIT in one round trip, as
        :meth:`transaction` sends it (elsewhere one statement per outbox just before
        the COMMIT). A rollback, or a rollback to a savepoint taken before the call
        (``begin_nested()``), drops it. Unlike :meth:`put`, the row is not in the
        table before the commit, and an error writing it is raised by ``commit()``::

            with Session(engine) as session, session.begin():
                session.add(order)
                outbox.defer(session, Event(topic="orders", event_type="order.placed", ...))
        """
        deferred.defer(conn, self, deferred.checked((event,), self._check))

    def defer_many(
        self, conn: sqlalchemy.orm.Session | sqlalchemy.engine.Connection, events: Iterable[Event]
    ) -> None:
        """:meth:`defer` for several events (at most 10 000 per call)."""
        deferred.defer(conn, self, deferred.checked(events, self._check))

    async def adefer(
        self,
        conn: sqlalchemy.ext.asyncio.AsyncSession | sqlalchemy.ext.asyncio.AsyncConnection,
        event: Event,
    ) -> None:
        """:meth:`defer` for a SQLAlchemy ``AsyncSession``/``AsyncConnection``."""
        await deferred.adefer(conn, self, deferred.checked((event,), self._check))

    async def adefer_many(
        self,
        conn: sqlalchemy.ext.asyncio.AsyncSession | sqlalchemy.ext.asyncio.AsyncConnection,
        events: Iterable[Event],
    ) -> None:
        """:meth:`adefer` for several events (at most 10 000 per call)."""
        await deferred.adefer(conn, self, deferred.checked(events, self._check))

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
        with self._attached_errors:
            return conn.execute(stmt, all_params)

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
        with self._attached_errors:
            if isinstance(conn, psycopg.AsyncConnection):
                stmt, all_params = self._attached(query, params, events)
                psycopg_adapter.check_in_transaction(conn)
                return await conn.execute(stmt, all_params)
            if asyncpg_adapter.Asyncpg.handles(type(conn)):
                stmt, all_params = self._attached(query, params, events, dollar=True)
                asyncpg_adapter.check_in_transaction(conn)
                return await conn.fetch(stmt, *all_params)
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
        # execute_with's connections (psycopg, asyncpg) are PostgreSQL's: its CTE is too.
        attached = self._writer_for(_POSTGRES).storage.attached(events, self._check)
        if attached is None:
            return query, list(params)
        cte, event_params = attached
        return _attach(query, params, cte, event_params, dollar)

    # -- async ----------------------------------------------------------------

    async def aput(self, conn: AsyncConnection, event: Event) -> None:
        """Async :meth:`put`: psycopg ``AsyncConnection``, asyncpg, SQLAlchemy async."""
        writer = self._writer_of(conn)
        stmt, params = writer.storage.one(self._check(event))
        with writer.errors:
            await async_adapter(conn, _WRITE).execute(conn, stmt, params, self._async_cursor)

    async def aput_many(self, conn: AsyncConnection, events: Iterable[Event]) -> None:
        """Async :meth:`put_many`."""
        writer = self._writer_of(conn)
        prepared = writer.storage.many(events, self._check)
        if prepared is None:
            return
        with writer.errors:
            await async_adapter(conn, _WRITE).execute(conn, *prepared, self._async_cursor)


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
