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
:class:`AsyncOutboxTransaction` (``async with``) are thin shells that run them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import struct
import zlib
from collections.abc import Callable, Generator, Iterable
from functools import partial
from itertools import islice
from types import TracebackType
from typing import Any, Generic, TypeVar

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.waiting import Ready, Wait

from outboxkit.drivers import psycopg_private as private
from outboxkit.drivers import type_name
from outboxkit.drivers.psycopg_adapter import check_usable
from outboxkit.errors import NotInTransactionError, outbox_table_missing
from outboxkit.events import Event
from outboxkit.limits import MAX_BATCH_EVENTS, too_many_events
from outboxkit.store.postgres import WRITE_COLUMNS, Statements, numbered
from outboxkit.store.wal_sql import WalStatements
from outboxkit.write.wal_envelope import encode_envelope

_IDLE = pq.TransactionStatus.IDLE
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_SYNC = pq.ExecStatus.PIPELINE_SYNC
# The INSERT's parameter types, all sent in binary: the outbox's columns
# (store.postgres.WRITE_COLUMNS), then the NOTIFY channel.
_OIDS = {"uuid": 2950, "text": 25, "bytea": 17, "jsonb": 3802, "timestamptz": 1184}
_TYPES = [_OIDS[pg_type] for _, pg_type in WRITE_COLUMNS]
_TYPES_NOTIFY = [*_TYPES, _OIDS["text"]]
_FORMATS = [1] * len(_TYPES)
_FORMATS_NOTIFY = [1] * len(_TYPES_NOTIFY)
_TYPES_KEY = tuple(_TYPES)
_TYPES_NOTIFY_KEY = tuple(_TYPES_NOTIFY)
_KEY = [name for name, _ in WRITE_COLUMNS].index("key")
_AVAILABLE_AT = [name for name, _ in WRITE_COLUMNS].index("available_at")
_TEXT_ARRAY = 1009  # text[]: the keys of an ordered commit's advisory locks
_INT32 = struct.Struct(">i")
_JSONB_EMPTY = b"\x01{}"  # jsonb binary format: version byte, then the JSON text
_Send = Callable[[], object]
# timestamptz binary format: microseconds since 2000-01-01 UTC, a big-endian int64.
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
_MICROSECOND = dt.timedelta(microseconds=1)
_INT64 = struct.Struct(">q")
_Conn = TypeVar("_Conn", bound=psycopg.Connection[Any] | psycopg.AsyncConnection[Any])


def _params(event: Event) -> list[bytes | None]:
    """The INSERT's parameters in binary: encoding happens once, at ``put``."""
    return [
        event.event_id.bytes,
        event.topic.encode(),
        event.key.encode() if event.key is not None else None,
        event.event_type.encode(),
        event.aggregate_type.encode() if event.aggregate_type is not None else None,
        event.aggregate_id.encode() if event.aggregate_id is not None else None,
        event.payload,
        b"\x01" + orjson.dumps(event.headers) if event.headers else _JSONB_EMPTY,
        _timestamptz(event.occurred_at),
        event.schema_version.encode() if event.schema_version is not None else None,
        _timestamptz(event.available_at) if event.available_at is not None else None,
    ]


def _timestamptz(value: dt.datetime) -> bytes:
    return _INT64.pack((value - _PG_EPOCH) // _MICROSECOND)


def _first_due(rows: list[list[bytes | None]]) -> int:
    """The first queued row due now (it carries the NOTIFY), -1 if all are scheduled later."""
    now: int | None = None
    for i, row in enumerate(rows):
        at = row[_AVAILABLE_AT]
        if at is None:
            return i
        if now is None:
            now = (dt.datetime.now(dt.UTC) - _PG_EPOCH) // _MICROSECOND
        if _INT64.unpack(at)[0] <= now:
            return i
    return -1


def _text_array(items: Iterable[bytes]) -> bytes:
    """A one-dimensional text[] without NULLs, in PostgreSQL's binary array format."""
    values = list(items)
    header = struct.pack(">iiiii", 1, 0, _OIDS["text"], len(values), 1)
    return header + b"".join(_INT32.pack(len(v)) + v for v in values)


def ordered_lock_params(rows: list[list[bytes | None]]) -> tuple[bool, list[bytes | None]] | None:
    """Whether the ordered commit locks several keys, and the lock parameter its first
    INSERT takes: the one key as text, or the distinct keys as a text[]. None when no
    queued event has a key (then no lock is taken)."""
    keys = {key for row in rows if (key := row[_KEY]) is not None}
    if not keys:
        return None
    if len(keys) == 1:
        return False, [keys.pop()]
    return True, [_text_array(keys)]


# storage="wal": the one parameter is the envelope (bytea), then the NOTIFY channel.
_WAL_TYPES = [_OIDS["bytea"]]
_WAL_TYPES_NOTIFY = [_OIDS["bytea"], _OIDS["text"]]
_WAL_FORMATS = [1]
_WAL_FORMATS_NOTIFY = [1, 1]


def _wal_params(event: Event) -> list[bytes | None]:
    return [encode_envelope(event)]


class CommitInserts:
    """What the commit path needs from an ``Outbox``, built once per outbox.

    The INSERT in ``$n`` style with its prepared-statement name per notify variant
    (the name follows the text, so outboxes of one table share it), the NOTIFY
    channel, the table (for errors) and the event check (the outbox's size limits).
    In ordered mode the first INSERT takes the keys' advisory locks (store.postgres
    KEY_LOCK/KEY_LOCKS): no command or round trip of their own, and the locks are held
    only while the COMMIT travels.
    """

    __slots__ = (
        "channel",
        "check",
        "inserts",
        "locking",
        "notify",
        "ordered",
        "row",
        "table",
        "wal",
    )

    def __init__(
        self,
        sql: Statements,
        *,
        notify: bool,
        check: Callable[[object], Event],
        ordered: bool = False,
        wal: WalStatements | None = None,
    ) -> None:
        self.table = sql.table
        self.notify = notify
        self.ordered = ordered
        self.check = check
        self.channel = sql.channel.encode()
        self.inserts: dict[bool, tuple[private.Key, bytes]] = {}
        for with_notify, stmt in ((False, sql.insert_one), (True, sql.insert_one_notify)):
            text = numbered(stmt).encode()
            key = (text, _TYPES_NOTIFY_KEY if with_notify else _TYPES_KEY)
            self.inserts[with_notify] = (key, b"outboxkit_put_%08x" % zlib.crc32(text))
        #: Encodes one event into its statement's parameters: a row, or a WAL envelope.
        self.row: Callable[[Event], list[bytes | None]] = _params
        #: storage="wal": "inserts" emit one logical message each (store.wal_sql).
        self.wal = wal is not None
        if wal is not None:
            self.row = _wal_params
            for with_notify, stmt in ((False, wal.emit_one), (True, wal.emit_one_notify)):
                text = numbered(stmt).encode()
                key = (text, tuple(_WAL_TYPES_NOTIFY if with_notify else _WAL_TYPES))
                self.inserts[with_notify] = (key, b"outboxkit_emit_%08x" % zlib.crc32(text))
        # Ordered mode: the first INSERT of the commit takes the transaction's key locks,
        # by (several keys, notify): one key as a text parameter, several as a text[].
        self.locking: dict[tuple[bool, bool], tuple[private.Key, bytes]] = {}
        for several, notifies, stmt in (
            (False, False, sql.insert_one_ordered),
            (False, True, sql.insert_one_ordered_notify),
            (True, False, sql.insert_one_locking_keys),
            (True, True, sql.insert_one_locking_keys_notify),
        ):
            text = numbered(stmt).encode()
            types = (*_TYPES, _TEXT_ARRAY if several else _OIDS["text"])
            types += (_OIDS["text"],) if notifies else ()
            name = b"outboxkit_put_%08x" % zlib.crc32(text)
            self.locking[several, notifies] = ((text, types), name)

    def prepared(self) -> list[tuple[private.Key, bytes]]:
        """Every statement the commit path may have prepared on a connection."""
        return [*self.inserts.values(), *self.locking.values()]


class BaseOutboxTransaction(Generic[_Conn]):
    """The protocol of a transaction whose events are written with its COMMIT.

    ``put``/``put_many`` only validate and queue: nothing is sent before the block
    ends. Without an exception the events are inserted and the transaction
    committed in one round trip; with one it is rolled back and nothing is sent.
    """

    def __init__(self, inserts: CommitInserts, conn: _Conn) -> None:
        self._inserts = inserts
        self.connection: _Conn = conn
        self._rows: list[list[bytes | None]] = []
        self._active = False

    # -- the application's side ---------------------------------------------------

    def put(self, event: Event) -> None:
        """Queue ``event``: validated now, written with the COMMIT."""
        self._require_active()
        self._rows.append(self._inserts.row(self._inserts.check(event)))

    def put_many(self, events: Iterable[Event]) -> None:
        """Queue several events, at most 10 000 per call (all validated before any is queued)."""
        self._require_active()
        check, row = self._inserts.check, self._inserts.row
        rows = [row(check(e)) for e in islice(events, MAX_BATCH_EVENTS + 1)]
        if len(rows) > MAX_BATCH_EVENTS:
            raise too_many_events()
        self._rows.extend(rows)

    def _require_active(self) -> None:
        if not self._active:
            raise NotInTransactionError(
                "this outbox transaction is not open: put() belongs inside its `with` block"
            )

    # -- opening and closing ----------------------------------------------------------

    def _opening(self) -> bool:
        """Check the connection; True if a BEGIN must be sent now (autocommit mode)."""
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
        return bool(conn.autocommit and status == _IDLE)

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

    def _commands(self) -> tuple[list[_Send], dict[int, tuple[private.Key, bytes]]]:
        """BEGIN if nothing has begun the transaction yet, the INSERTs, COMMIT.

        Also returns the positions of the Prepare commands with their cache keys:
        a Prepare the server skipped (after an earlier error) is not taken for done.
        """
        conn = self.connection
        pgconn = conn.pgconn
        sends: list[_Send] = []
        prepares: dict[int, tuple[private.Key, bytes]] = {}
        if pgconn.transaction_status == _IDLE:
            sends.append(partial(pgconn.send_query_params, b"BEGIN", None))
        ins = self._inserts
        # prepare_threshold=None is how psycopg users say "behind PgBouncer, no named
        # prepared statements": then each INSERT is parsed on its own.
        prepare = conn.prepare_threshold is not None

        def send(
            statement: tuple[private.Key, bytes],
            params: list[bytes | None],
            types: list[int],
            formats: list[int],
        ) -> None:
            key, name = statement
            if not prepare:
                sends.append(partial(pgconn.send_query_params, key[0], params, types, formats))
                return
            if (key, name) not in prepares.values() and private.prepared_name(conn, key) != name:
                prepares[len(sends)] = (key, name)
                sends.append(partial(pgconn.send_prepare, name, key[0], types))
            sends.append(partial(pgconn.send_query_prepared, name, params, formats))

        if ins.wal:  # one logical message per event; the NOTIFY (if asked for) on the first
            for i, row in enumerate(self._rows):
                if i == 0 and ins.notify:
                    notify_row = [*row, ins.channel]
                    send(ins.inserts[True], notify_row, _WAL_TYPES_NOTIFY, _WAL_FORMATS_NOTIFY)
                else:
                    send(ins.inserts[False], row, _WAL_TYPES, _WAL_FORMATS)
            sends.append(partial(pgconn.send_query_params, b"COMMIT", None))
            return sends, prepares
        # PostgreSQL folds repeats of one notification: the first row due now carries it
        # (none when every event is scheduled for later).
        notify_at = _first_due(self._rows) if ins.notify else -1
        lock = ordered_lock_params(self._rows) if ins.ordered else None
        for i, row in enumerate(self._rows):
            if i == 0 and lock is not None:
                # The key locks, before this row and the later ones take their ids.
                several, lock_params = lock
                statement = ins.locking[several, i == notify_at]
                params = [*row, *lock_params, ins.channel] if i == notify_at else row + lock_params
                types = list(statement[0][1])
                send(statement, params, types, [1] * len(types))
            elif i == notify_at:
                send(ins.inserts[True], [*row, ins.channel], _TYPES_NOTIFY, _FORMATS_NOTIFY)
            else:
                send(ins.inserts[False], row, _TYPES, _FORMATS)
        sends.append(partial(pgconn.send_query_params, b"COMMIT", None))
        return sends, prepares

    def _commit_gen(self) -> Generator[Wait, Ready | int, None]:
        """The commit as a generator for ``conn.wait()``: raises the server's error."""
        conn = self.connection
        try:
            if conn.prepare_threshold is not None:
                yield from private.flush_deallocations(conn)
            sends, prepares = self._commands()
        finally:
            self._rows = []
        statuses, error = yield from _pipeline(conn.pgconn, sends)
        for index, (key, name) in prepares.items():
            if index < len(statuses) and statuses[index] in _OK:
                private.remember_prepared(conn, key, name)
        if isinstance(error, pg_errors.InvalidSqlStatementName):
            # The session lost its prepared statements behind psycopg's back (a pooler's
            # reset): this transaction is rolled back, the next one prepares again.
            for key, _ in self._inserts.prepared():
                private.forget_prepared(conn, key)
        if error is not None:
            if missing := outbox_table_missing(error, self._inserts.table, rolled_back=True):
                raise missing from error
            raise error


class OutboxTransaction(BaseOutboxTransaction[psycopg.Connection[Any]]):
    """A transaction whose events are written with its COMMIT: :meth:`Outbox.transaction`."""

    def __init__(self, inserts: CommitInserts, conn: psycopg.Connection[Any]) -> None:
        if not isinstance(conn, psycopg.Connection):
            raise _unsupported(conn, "transaction", "psycopg.Connection")
        super().__init__(inserts, conn)

    def __enter__(self) -> OutboxTransaction:
        if self._opening():
            self.connection.execute("BEGIN")
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

    def __init__(self, inserts: CommitInserts, conn: psycopg.AsyncConnection[Any]) -> None:
        if not isinstance(conn, psycopg.AsyncConnection):
            raise _unsupported(conn, "atransaction", "psycopg.AsyncConnection")
        super().__init__(inserts, conn)

    async def __aenter__(self) -> AsyncOutboxTransaction:
        if self._opening():
            await self.connection.execute("BEGIN")
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


def _pipeline(
    pgconn: Any, sends: list[_Send]
) -> Generator[Wait, Ready | int, tuple[list[pq.ExecStatus], Exception | None]]:
    """Send ``sends`` and one Sync as a pipeline; read every result up to the Sync.

    Returns each command's result status, in order, and the first error the server
    reported (it skips the rest of the pipeline after one). Runs under
    ``conn.wait()``, so the same code serves sync and async connections.
    """
    pgconn.enter_pipeline_mode()
    statuses: list[pq.ExecStatus] = []
    error: Exception | None = None
    try:
        for send in sends:
            send()
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
                status = pq.ExecStatus(result.status)
                if status == _SYNC:
                    synced = True
                    continue
                statuses.append(status)
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
