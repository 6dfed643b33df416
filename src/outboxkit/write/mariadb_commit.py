"""``Outbox.transaction()`` on MariaDB/MySQL: the events travel with the COMMIT.

``put`` inside the caller's transaction is a statement and a round trip of its own (+26 %
on the reference transaction, docs/benchmarks.md). Here ``tx.put`` only checks and queues;
at the end of the block the events' multi-row INSERT and the COMMIT go to the server as one
multi-statement query (``INSERT …;\\nCOMMIT``), one round trip. The server runs nothing
after a failed statement, so a failed INSERT never reaches the COMMIT: outboxkit rolls back
and raises the error. If the block raises, nothing is sent and the transaction is rolled
back. A failed COMMIT (a deadlock, a lost connection) raises; after a lost connection the
outcome is unknown, as for any COMMIT.

The one round trip needs a connection opened with ``CLIENT.MULTI_STATEMENTS``: mysqlclient,
aiomysql and asyncmy always ask for it; PyMySQL only when told
(``pymysql.connect(..., client_flag=CLIENT.MULTI_STATEMENTS)``). Without it the INSERT and
the COMMIT are sent one after the other (two round trips, the same atomicity) and a warning
says once how to open the connection. Once the COMMIT returned, the relays of this process
are woken (``backends.mariadb.wakeup``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

from outboxkit.backends.mariadb import wakeup
from outboxkit.drivers import Statement, type_name
from outboxkit.drivers.dbapi_adapter import DBAPIAsync, DBAPISync
from outboxkit.errors import NotInTransactionError, outbox_table_missing
from outboxkit.events import Event
from outboxkit.limits import MAX_BATCH_EVENTS
from outboxkit.write.mariadb_table import MariaDBTableStorage, due
from outboxkit.write.storage import Check, encode_batch

log = logging.getLogger("outboxkit.write")
_A = TypeVar("_A", DBAPISync, DBAPIAsync)
#: Driver connection types already warned about (no CLIENT.MULTI_STATEMENTS).
_WARNED: set[type] = set()


class MySQLConnection(Protocol):
    """What a type checker takes for ``transaction()`` on MariaDB: a DB-API MySQL
    connection (PyMySQL, mysqlclient; aiomysql, asyncmy for ``atransaction()``), not a
    pool, an engine or a session."""

    def get_autocommit(self) -> Any: ...

    def begin(self) -> Any: ...


class BaseMariaDBTransaction(Generic[_A]):
    """The state and checks both shells share; the driver's adapter does the I/O."""

    def __init__(self, storage: MariaDBTableStorage, check: Check, conn: Any, adapter: _A) -> None:
        self._storage = storage
        self._check = check
        self._adapter: _A = adapter
        self.connection = conn
        self._rows: list[tuple[Any, ...]] = []
        self._active = False

    def put(self, event: Event) -> None:
        """Queue ``event``: checked now, written with the COMMIT."""
        self._require_active()
        self._rows.append(self._storage.row(self._check(event)))

    def put_many(self, events: Iterable[Event]) -> None:
        """Queue several events, at most 10 000 per call (all checked before any is queued)."""
        self._require_active()
        self._rows.extend(encode_batch(events, self._check, self._storage.row))

    def _require_active(self) -> None:
        if not self._active:
            raise NotInTransactionError(
                "this outbox transaction is not open: put() belongs inside its `with` block"
            )

    def _statement(self) -> tuple[Statement, list[Any]] | None:
        """The INSERTs of the queued rows as one text (a batch's worth per INSERT)."""
        if not self._rows:
            return None
        texts: list[str] = []
        params: list[Any] = []
        for start in range(0, len(self._rows), MAX_BATCH_EVENTS):
            stmt, values = self._storage.insert(self._rows[start : start + MAX_BATCH_EVENTS])
            texts.append(stmt.text)
            params.extend(values)
        text = ";\n".join(texts)
        return Statement(text, text), params

    def _warn_single_statements(self) -> None:
        conn_type = type(self.connection)
        adapter = self._adapter
        if (
            isinstance(adapter, DBAPISync)
            and conn_type not in _WARNED
            and not adapter.multi_statements(self.connection)
        ):
            _WARNED.add(conn_type)
            log.warning(
                "Outbox.transaction(): this %s was opened without CLIENT.MULTI_STATEMENTS,"
                " so the events' INSERT and the COMMIT take two round trips; open it with"
                " client_flag=CLIENT.MULTI_STATEMENTS (pymysql.constants.CLIENT) for one",
                adapter.label,
            )

    def _failed(self, exc: BaseException) -> BaseException:
        """The error to raise for a failed commit: outboxkit's for a missing table."""
        if isinstance(exc, Exception):
            missing = outbox_table_missing(exc, self._storage.table, rolled_back=True)
            if missing is not None:
                return missing
        return exc

    def _woke(self) -> None:
        if self._rows and wakeup.has_relays() and due(self._rows):
            wakeup.committed(self._storage.table)


class MariaDBTransaction(BaseMariaDBTransaction[DBAPISync]):
    """``with outbox.transaction(conn) as tx``: PyMySQL or mysqlclient."""

    def __enter__(self) -> MariaDBTransaction:
        if self._adapter.needs_begin(self.connection):
            self.connection.begin()
        self._warn_single_statements()
        self._active = True
        return self

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._active = False
        if exc is not None:
            self._rows = []
            self._roll_back()  # the block raised: roll back, without hiding its exception
            return
        statement = self._statement()
        try:
            if statement is None:
                self.connection.commit()
            else:
                self._adapter.commit_with(self.connection, *statement)
        except BaseException as failed:
            self._roll_back()
            error = self._failed(failed)
            if error is failed:
                raise
            raise error from failed
        self._woke()
        self._rows = []

    def _roll_back(self) -> None:
        with contextlib.suppress(Exception):  # a lost connection rolled back already
            self.connection.rollback()


class AsyncMariaDBTransaction(BaseMariaDBTransaction[DBAPIAsync]):
    """``async with outbox.atransaction(conn) as tx``: aiomysql or asyncmy."""

    async def __aenter__(self) -> AsyncMariaDBTransaction:
        if self._adapter.needs_begin(self.connection):
            await self.connection.begin()
        self._active = True
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._active = False
        if exc is not None:
            self._rows = []
            await self._roll_back()
            return
        statement = self._statement()
        try:
            if statement is None:
                await self.connection.commit()
            else:
                await self._adapter.commit_with(self.connection, *statement)
        except BaseException as failed:
            await self._roll_back()
            error = self._failed(failed)
            if error is failed:
                raise
            raise error from failed
        self._woke()
        self._rows = []

    async def _roll_back(self) -> None:
        with contextlib.suppress(Exception):
            await self.connection.rollback()


def unsupported(conn: object, method: str, expected: str) -> Exception:
    return TypeError(
        f"Outbox(storage='mariadb').{method}() needs a {expected} connection, got"
        f" {type_name(conn)}; with SQLAlchemy use defer(), elsewhere put() inside your"
        " own transaction"
    )
