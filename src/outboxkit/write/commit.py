"""``Outbox.transaction()``: the events are written in the round trip of the COMMIT.

A separate INSERT costs a round trip of its own, which on a ~1 ms, nine-statement
transaction is most of the outbox's price (docs/benchmarks.md). Here the events
are only validated and encoded when the application calls ``put``; at the end of
the block they travel with the COMMIT in one libpq pipeline — a prepared INSERT
per event, then COMMIT, then one Sync — so the write adds no round trip at all.

Atomicity does not change: the INSERTs run inside the transaction, before the
COMMIT. If one fails, PostgreSQL skips the COMMIT, the transaction is rolled
back and the error is raised; if the block raises, the events were never sent.

As psycopg's own ``transaction.py``: the protocol lives once, as generators, in
:class:`BaseOutboxTransaction`; :class:`OutboxTransaction` (``with``) and
:class:`AsyncOutboxTransaction` (``async with``) are thin shells that run them. What
the pipeline carries per event (a row's INSERT or a WAL message) is the storage's
business (``write.storage``); this module knows neither.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Generator, Iterable
from types import TracebackType
from typing import Any, Generic, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import generators, pq
from psycopg.waiting import Ready, Wait

from outboxkit.backends.postgres._connection import detect_pooling
from outboxkit.drivers import psycopg_private as private
from outboxkit.drivers import type_name
from outboxkit.drivers.psycopg_adapter import check_usable
from outboxkit.errors import NotInTransactionError, outbox_table_missing
from outboxkit.events import Event
from outboxkit.write.storage import (
    BinaryRow,
    Check,
    CommitStatement,
    PipelinedStorage,
    encode_batch,
)

_IDLE = pq.TransactionStatus.IDLE
_INTRANS = pq.TransactionStatus.INTRANS
# Result statuses as plain ints: an ExecStatus(...) per result cost ~1 µs each.
_OK = frozenset((int(pq.ExecStatus.COMMAND_OK), int(pq.ExecStatus.TUPLES_OK)))
_SYNC = int(pq.ExecStatus.PIPELINE_SYNC)
_COMMAND_OK = int(pq.ExecStatus.COMMAND_OK)
#: One statement of the COMMIT's pipeline: its parameters, and how it is sent: parsed on
#: its own (0), by name (_NAMED), or by name after a Prepare (_PREPARE).
_Command = tuple[CommitStatement, BinaryRow, int]
_NAMED, _PREPARE = 1, 2
_Conn = TypeVar("_Conn", bound=psycopg.Connection[Any] | psycopg.AsyncConnection[Any])
#: Per connection: whether named statements outlive a transaction there (not behind a
#: transaction pooler that drops them, PgBouncer before 1.21), found at its first commit.
_KEEPS_PREPARED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


class BaseOutboxTransaction(Generic[_Conn]):
    """The protocol of a transaction whose events are written with its COMMIT.

    ``put``/``put_many`` only validate and queue: nothing is sent before the block
    ends. Without an exception the events are inserted and the transaction
    committed in one round trip; with one it is rolled back and nothing is sent.
    """

    __slots__ = ("_active", "_check", "_rows", "_storage", "connection")
    #: The connection class this transaction runs on, and how a wrong one is refused.
    _connection_type: type = psycopg.Connection
    _refusal = ("transaction", "psycopg.Connection")
    #: Whether :meth:`_committed` wants each statement's first returned value (a task
    #: transaction's new ids); the outbox's events need none, so it reads none.
    _reads_values = False

    def __init__(self, storage: PipelinedStorage, check: Check, conn: _Conn) -> None:
        if not isinstance(conn, self._connection_type):
            raise _unsupported(conn, *self._refusal)
        self._storage = storage
        self._check = check
        self.connection: _Conn = conn
        self._rows: list[BinaryRow] = []
        self._active = False

    # -- the application's side ---------------------------------------------------

    def put(self, event: Event) -> None:
        """Queue ``event``: validated now, written with the COMMIT."""
        if not self._active:
            self._require_active()
        self._rows.append(self._storage.encode(self._check(event)))

    def put_many(self, events: Iterable[Event]) -> None:
        """Queue several events, at most 10 000 per call (all validated before any is queued)."""
        self._require_active()
        self._rows.extend(encode_batch(events, self._check, self._storage.encode))

    def _require_active(self) -> None:
        if not self._active:
            raise NotInTransactionError(
                "this outbox transaction is not open: put() belongs inside its `with` block"
            )

    # -- opening and closing ----------------------------------------------------------

    def _opening(self) -> bytes | None:
        """Check the connection; the BEGIN to send now (autocommit mode), else None."""
        conn = self.connection
        status = check_usable(conn)
        if private.in_pipeline(conn):
            raise NotInTransactionError(
                "Outbox.transaction() cannot run inside conn.pipeline(): it commits through"
                " a pipeline of its own"
            )
        if private.open_transaction_blocks(conn) > 0:
            raise NotInTransactionError(
                "Outbox.transaction() would commit inside an open `with conn.transaction():`"
                " block; use it instead of that block (or use outbox.put() inside it)"
            )
        self._active = True
        return private.begin_command(conn) if conn.autocommit and status == _IDLE else None

    def _closing(self, exc: BaseException | None) -> bool:
        """Close the block; True if there is something to commit."""
        self._active = False
        if exc is not None:
            self._rows = []
            return False
        return bool(self._rows) or self.connection.pgconn.transaction_status != _IDLE

    def _must_roll_back(self) -> bool:
        self._rows = []
        conn = self.connection
        return not conn.closed and conn.pgconn.transaction_status != _IDLE

    def _prepares(self) -> Generator[Wait, Ready | int, bool]:
        """Whether to send named prepared statements on this connection, the first time.

        Not with ``prepare_threshold=None`` (psycopg's "behind PgBouncer" switch), nor
        behind a pooler that keeps none (found once per connection, in its first commit:
        ``store._connection.detect_pooling``, a round trip or two); a prepared statement
        there would exist on one server connection and be missing on the next.
        """
        conn = self.connection
        if conn.pgconn.transaction_status not in (_IDLE, _INTRANS):
            return False  # (a failed transaction: the COMMIT reports it)
        pooling = yield from detect_pooling(conn)
        keeps: bool = pooling.prepared
        _KEEPS_PREPARED[conn] = keeps
        return keeps

    def _commands(self, prepare: bool) -> list[_Command]:
        """The storage's statements for the queued rows, each with how it is sent (by
        name, by name after a Prepare, or parsed on its own); decided before the
        pipeline starts, so nothing in Python can fail halfway through it."""
        commands: list[_Command] = []
        if not prepare:  # (no named statements here: _prepares) each one parsed on its own
            self._storage.commit_inserts(self._rows, lambda s, p: commands.append((s, p, 0)))
            return commands
        conn = self.connection
        preparing: list[CommitStatement] = []

        def send(statement: CommitStatement, params: BinaryRow) -> None:
            if (
                statement in preparing
                or private.prepared_name(conn, statement.key) == statement.name
            ):
                commands.append((statement, params, _NAMED))
            else:
                preparing.append(statement)
                commands.append((statement, params, _PREPARE))

        self._storage.commit_inserts(self._rows, send)
        return commands

    def _commit_gen(self) -> Generator[Wait, Ready | int, None]:
        """The commit as a generator for ``conn.wait()``: raises the server's error."""
        conn = self.connection
        pgconn = conn.pgconn
        try:
            # Known after the connection's first commit: no generator to run.
            prepare = conn.prepare_threshold is not None and _KEEPS_PREPARED.get(conn)
            if prepare is None:
                prepare = yield from self._prepares()
            if prepare:
                yield from private.flush_deallocations(conn)
            commands = self._commands(prepare) if self._rows else []
        finally:
            self._rows = []
        begin = pgconn.transaction_status == _IDLE
        values: list[bytes | None] | None = [] if self._reads_values else None
        statuses, error = yield from _pipeline(pgconn, begin, commands, values)
        if prepare:
            # A Prepare the server skipped (after an earlier error) is not taken for done.
            at = int(begin)
            for statement, _, how in commands:
                if how == _PREPARE:
                    if at < len(statuses) and statuses[at] in _OK:
                        private.remember_prepared(conn, statement.key, statement.name)
                    at += 1
                at += 1
        if error is not None:
            if isinstance(error, pg_errors.InvalidSqlStatementName):
                # The session lost its prepared statements behind psycopg's back (a
                # pooler's reset): this transaction is rolled back, the next one
                # prepares again.
                for statement in self._storage.prepared():
                    private.forget_prepared(conn, statement.key)
            if missing := outbox_table_missing(error, self._storage.table, rolled_back=True):
                raise missing from error
            raise error
        if values is not None:
            # Each command's first value, in the order the storage queued them (the BEGIN's
            # and the Prepares' results, and the COMMIT's, are not the commands').
            at = int(begin)
            mine: list[bytes | None] = []
            for _statement, _params, how in commands:
                at += how == _PREPARE
                mine.append(values[at] if at < len(values) else None)
                at += 1
            self._committed(mine)

    def _committed(self, values: list[bytes | None]) -> None:
        """After a successful COMMIT: each queued statement's first returned value (text),
        or None where it returned no row (only when :attr:`_reads_values`)."""


class OutboxTransaction(BaseOutboxTransaction[psycopg.Connection[Any]]):
    """A transaction whose events are written with its COMMIT: :meth:`Outbox.transaction`."""

    __slots__ = ()

    def __enter__(self) -> OutboxTransaction:
        begin = self._opening()
        if begin is not None:
            conn = self.connection
            with conn.lock:
                conn.wait(_begin_gen(conn.pgconn, begin))
        return self

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        conn = self.connection
        try:
            if self._closing(exc):
                with conn.lock:  # as psycopg's own transaction(): one user of the socket
                    conn.wait(self._commit_gen())
                return
        except BaseException:
            self._roll_back()  # never hides the error that matters
            raise
        if exc is not None:
            self._roll_back()  # the block raised: roll back, without hiding its exception

    def _roll_back(self) -> None:
        with contextlib.suppress(psycopg.Error):
            if self._must_roll_back():
                self.connection.rollback()


class AsyncOutboxTransaction(BaseOutboxTransaction[psycopg.AsyncConnection[Any]]):
    """:class:`OutboxTransaction` for psycopg ``AsyncConnection``: :meth:`Outbox.atransaction`."""

    __slots__ = ()
    _connection_type = psycopg.AsyncConnection
    _refusal = ("atransaction", "psycopg.AsyncConnection")

    async def __aenter__(self) -> AsyncOutboxTransaction:
        begin = self._opening()
        if begin is not None:
            conn = self.connection
            async with conn.lock:
                await conn.wait(_begin_gen(conn.pgconn, begin))
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        conn = self.connection
        try:
            if self._closing(exc):
                async with conn.lock:
                    await conn.wait(self._commit_gen())
                return
        except BaseException:
            await self._roll_back()
            raise
        if exc is not None:
            await self._roll_back()

    async def _roll_back(self) -> None:
        with contextlib.suppress(psycopg.Error):
            if self._must_roll_back():
                await self.connection.rollback()


def _begin_gen(pgconn: Any, command: bytes) -> Generator[Wait, Ready | int, None]:
    """Send ``command`` (a BEGIN) as one simple query and read its result, as psycopg's
    ``conn.transaction()`` does: a third of the client CPU of ``conn.execute("BEGIN")``,
    which builds a cursor and runs the statement through its prepare bookkeeping."""
    pgconn.send_query(command)
    results = yield from generators.execute(pgconn)
    for result in results:
        if result.status != _COMMAND_OK:
            raise pg_errors.error_from_result(result, encoding=private.encoding(pgconn))


def _pipeline(
    pgconn: Any, begin: bool, commands: list[_Command], values: list[bytes | None] | None = None
) -> Generator[Wait, Ready | int, tuple[list[int], Exception | None]]:
    """Send a BEGIN (if ``begin``), ``commands``, COMMIT and one Sync as a pipeline; read
    every result up to the Sync.

    Returns each command's result status, in order, and the first error the server
    reported (it skips the rest of the pipeline after one); ``values``, when given, gets
    each result's first value (None without a row), in the statuses' order. Runs under
    ``conn.wait()``, so the same code serves sync and async connections.
    """
    pgconn.enter_pipeline_mode()
    statuses: list[int] = []
    error: Exception | None = None
    try:
        if begin:
            pgconn.send_query_params(b"BEGIN", None)
        for (key, name, types, formats), params, how in commands:
            if not how:
                pgconn.send_query_params(key[0], params, types, formats)
                continue
            if how == _PREPARE:
                pgconn.send_prepare(name, key[0], types)
            pgconn.send_query_prepared(name, params, formats)
        pgconn.send_query_params(b"COMMIT", None)
        pgconn.pipeline_sync()
        while pgconn.flush():
            while not (yield Wait.W):
                pass
        synced = False
        while not synced:
            while not (yield Wait.R):
                pass
            pgconn.consume_input()
            nulls = 0
            while not synced and nulls < 2 and not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    nulls += 1  # the end of a command's results; twice: nothing more yet
                    continue
                nulls = 0
                status = result.status
                if status == _SYNC:
                    synced = True
                    continue
                statuses.append(status)
                if values is not None:
                    values.append(result.get_value(0, 0) if result.ntuples else None)
                if status not in _OK and error is None:
                    error = _error(result, pgconn)
    finally:
        if pgconn.pipeline_status:
            pgconn.exit_pipeline_mode()
    return statuses, error


def _error(result: Any, pgconn: Any) -> Exception:
    if result.status == pq.ExecStatus.PIPELINE_ABORTED:
        return pg_errors.InFailedSqlTransaction("pipeline aborted")
    return pg_errors.error_from_result(result, encoding=private.encoding(pgconn))


def _unsupported(conn: object, method: str, expected: str) -> Exception:
    return TypeError(
        f"Outbox.{method}() needs a {expected}, got {type_name(conn)};"
        " with other drivers use put()/aput() inside your own transaction"
    )
