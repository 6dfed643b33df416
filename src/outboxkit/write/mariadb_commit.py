"""``Outbox.transaction()`` on MariaDB/MySQL: the events travel with the COMMIT.

``put`` inside the caller's transaction is a statement and a round trip of its own (+26 %
on the reference transaction, docs/benchmarks.md). Here ``tx.put`` only checks and queues;
at the end of the block the events' multi-row INSERT and the COMMIT go to the server as one
multi-statement query (``INSERT …;\\nCOMMIT``), one round trip. The server runs nothing
after a failed statement, so a failed INSERT never reaches the COMMIT: outboxkit rolls back
and raises the error. If the block raises, nothing is sent and the transaction is rolled
back. A failed COMMIT (a deadlock, a lost connection) raises; after a lost connection the
outcome is unknown, as for any COMMIT. A deadlock or a lock wait timeout raises
``TransactionConflictError``: the whole transaction is gone, the caller runs it again.

Events too many for the server's ``max_allowed_packet`` go as several INSERTs, the last
with the COMMIT; one too large for any is refused before anything is sent
(``write.mariadb_packet``).

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
from outboxkit.errors import NotInTransactionError, outbox_table_missing, transaction_conflict
from outboxkit.events import Event
from outboxkit.limits import MAX_BATCH_EVENTS
from outboxkit.write import mariadb_packet as packet
from outboxkit.write.mariadb_table import due
from outboxkit.write.storage import Check, encode_batch

log = logging.getLogger("outboxkit.write")
_A = TypeVar("_A", DBAPISync, DBAPIAsync)
#: Driver connection types already warned about (no CLIENT.MULTI_STATEMENTS).
_WARNED: set[type] = set()
#: A bound of an INSERT's text besides its values (the ordered one, with a few keys).
_FIXED_BOUND = 4096


class MySQLConnection(Protocol):
    """What a type checker takes for ``transaction()`` on MariaDB: a DB-API MySQL
    connection (PyMySQL, mysqlclient; aiomysql, asyncmy for ``atransaction()``), not a
    pool, an engine or a session."""

    def get_autocommit(self) -> Any: ...

    def begin(self) -> Any: ...


class RowStorage(Protocol):
    """What the shells ask of a storage: :class:`MariaDBTableStorage` (events), or task
    rows (tasks/enqueue_mariadb.py, ``Tasks.transaction()``)."""

    table: str

    def row(self, value: Any) -> tuple[Any, ...]: ...

    def slots(self, rows: list[tuple[Any, ...]]) -> list[int]: ...

    def shape(self, slots: int) -> tuple[int, int]: ...

    def insert(
        self, rows: list[tuple[Any, ...]], slots: list[int] | None = None
    ) -> tuple[Statement, list[Any]]: ...


class BaseMariaDBTransaction(Generic[_A]):
    """The state and checks both shells share; the driver's adapter does the I/O."""

    #: Who speaks in the warning (``Tasks.transaction()`` too).
    _what = "Outbox.transaction()"

    def __init__(self, storage: RowStorage, check: Check, conn: Any, adapter: _A) -> None:
        self._storage = storage
        self._check = check
        self._adapter: _A = adapter
        self.connection = conn
        self._rows: list[tuple[Any, ...]] = []
        self._bound = 0  # an upper bound of the rows' quoted values (mariadb_packet)
        self._active = False

    def put(self, event: Event) -> None:
        """Queue ``event``: checked now, written with the COMMIT."""
        self._require_active()
        self._queue([self._storage.row(self._check(event))])

    def put_many(self, events: Iterable[Event]) -> None:
        """Queue several events, at most 10 000 per call (all checked before any is queued)."""
        self._require_active()
        self._queue(encode_batch(events, self._check, self._storage.row))

    def _queue(self, rows: list[tuple[Any, ...]]) -> None:
        bounds = [packet.quick_size(row) for row in rows]
        if max(bounds, default=0) > packet.ASK_ABOVE - _FIXED_BOUND:
            self._refuse_oversized(rows)
        self._rows.extend(rows)
        self._bound += sum(bounds)

    def _refuse_oversized(self, rows: list[tuple[Any, ...]]) -> None:
        """Refuse, before it is queued, a row no INSERT can carry under the limit (when the
        limit can be known here: the sync shell asks, the async one only if known)."""
        limit = self._limit_now()
        if limit is None:
            return  # refused at the end of the block, before anything is sent
        fixed, per_row = self._storage.shape(len(self._storage.slots(rows)))
        for i, row in enumerate(rows):
            size = fixed + per_row + packet.exact_size(row)
            if size > limit - packet.SLACK:
                raise self._too_large(len(self._rows) + i, row, size, limit)

    def _limit_now(self) -> int | None:
        return packet.known(self.connection)

    def _too_large(self, position: int, row: tuple[Any, ...], size: int, limit: int) -> Exception:
        """The refusal of the row at ``position`` whose statement alone exceeds ``limit``."""
        return packet.too_large(position, row, size, limit)

    def _committed(self, values: list[Any]) -> None:
        """After the COMMIT: the first value of each statement's result set, in order (an
        outbox INSERT has none; ``Tasks.transaction()``'s give the new tasks' ids)."""

    def _require_active(self) -> None:
        if not self._active:
            raise NotInTransactionError(
                "this outbox transaction is not open: put() belongs inside its `with` block"
            )

    def _may_exceed(self) -> bool:
        """Whether the queued rows' INSERTs may outgrow a small limit (then it is asked)."""
        return self._bound + _FIXED_BOUND * (1 + len(self._rows) // MAX_BATCH_EVENTS) > (
            packet.ASK_ABOVE
        )

    def _statements(self, limit: int | None) -> list[tuple[Statement, list[Any]]]:
        """The queries of the queued rows' INSERTs, the last to go with the COMMIT: one
        (a batch's worth per INSERT) unless ``limit`` (the server's max_allowed_packet)
        needs several; an event too large for any is refused here, before any is sent."""
        rows = self._rows
        if not rows:
            return []
        if limit is None:
            return [self._joined(rows)]
        slots = self._storage.slots(rows)
        fixed, per_row = self._storage.shape(len(slots))
        one = self._bound + fixed * (1 + len(rows) // MAX_BATCH_EVENTS) + per_row * len(rows)
        if one <= limit - packet.SLACK:
            return [self._joined(rows)]
        sizes = [packet.exact_size(row) for row in rows]
        try:
            ranges = packet.chunks(sizes, fixed, per_row, limit, MAX_BATCH_EVENTS)
        except packet._RowTooLarge as big:
            raise self._too_large(big.position, rows[big.position], big.size, limit) from None
        if len(ranges) == 1:
            return [self._joined(rows)]
        # Ordered mode: every INSERT locks all of the transaction's keys, in one order, so
        # two split transactions never take them in crossed orders (no deadlock between them).
        return [self._storage.insert(rows[a:b], slots or None) for a, b in ranges]

    def _joined(self, rows: list[tuple[Any, ...]]) -> tuple[Statement, list[Any]]:
        """The INSERTs of ``rows`` as one text (a batch's worth per INSERT)."""
        texts: list[str] = []
        params: list[Any] = []
        for start in range(0, len(rows), MAX_BATCH_EVENTS):
            stmt, values = self._storage.insert(rows[start : start + MAX_BATCH_EVENTS])
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
                "%s: this %s was opened without CLIENT.MULTI_STATEMENTS, so its statements"
                " and the COMMIT take a round trip each; open it with"
                " client_flag=CLIENT.MULTI_STATEMENTS (pymysql.constants.CLIENT) for one",
                self._what,
                adapter.label,
            )

    def _failed(self, exc: BaseException) -> BaseException:
        """The error to raise for a failed commit: outboxkit's for a missing table, a
        deadlock or a lock wait timeout (the caller runs the whole transaction again)."""
        if isinstance(exc, Exception):
            missing = outbox_table_missing(exc, self._storage.table, rolled_back=True)
            if missing is not None:
                return missing
            conflict = transaction_conflict(exc, rolled_back=True)
            if conflict is not None:
                return conflict
        return exc

    def _woke(self) -> None:
        if self._rows and wakeup.has_relays() and due(self._rows):
            wakeup.committed(self._storage.table)


class MariaDBTransaction(BaseMariaDBTransaction[DBAPISync]):
    """``with outbox.transaction(conn) as tx``: PyMySQL or mysqlclient."""

    def _limit_now(self) -> int | None:
        return packet.ask(self.connection)

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
            self._rows, self._bound = [], 0
            self._roll_back()  # the block raised: roll back, without hiding its exception
            return
        try:
            limit = packet.ask(self.connection) if self._may_exceed() else None
            statements = self._statements(limit)
            values: list[Any] = []
            for stmt, params in statements[:-1]:  # over max_allowed_packet: several INSERTs
                values += self._adapter.run_all(self.connection, stmt, params)
            if statements:
                values += self._adapter.commit_with(self.connection, *statements[-1])
            else:
                self.connection.commit()
        except BaseException as failed:
            self._roll_back()
            error = self._failed(failed)
            if error is failed:
                raise
            raise error from failed
        self._woke()
        self._committed(values)
        self._rows = []
        self._bound = 0

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
            self._rows, self._bound = [], 0
            await self._roll_back()
            return
        try:
            limit = await packet.aask(self.connection) if self._may_exceed() else None
            statements = self._statements(limit)
            values: list[Any] = []
            for stmt, params in statements[:-1]:
                values += await self._adapter.run_all(self.connection, stmt, params)
            if statements:
                values += await self._adapter.commit_with(self.connection, *statements[-1])
            else:
                await self.connection.commit()
        except BaseException as failed:
            await self._roll_back()
            error = self._failed(failed)
            if error is failed:
                raise
            raise error from failed
        self._woke()
        self._committed(values)
        self._rows = []
        self._bound = 0

    async def _roll_back(self) -> None:
        with contextlib.suppress(Exception):
            await self.connection.rollback()


def unsupported(conn: object, method: str, expected: str) -> Exception:
    return TypeError(
        f"Outbox(storage='mariadb').{method}() needs a {expected} connection, got"
        f" {type_name(conn)}; with SQLAlchemy use defer(), elsewhere put() inside your"
        " own transaction"
    )
