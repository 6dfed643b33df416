"""Outbox(storage="wal"): every API and driver writes one decodable logical message per event.

Read back from a logical replication slot (pgoutput, messages on) on a server started
with wal_level=logical: what a CDC relay would receive, in commit order. A rolled-back
transaction, a refused call and a bad event emit nothing; no outbox row is ever written.
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outboxkit import (
    ConfigurationError,
    Event,
    InvalidEventError,
    NotInTransactionError,
    Outbox,
    TableNotFoundError,
)
from outboxkit.cdc.envelope import decode_envelope
from outboxkit.write.wal_envelope import parse_envelope

SLOT = "wal_write_test"
PUBLICATION = "wal_write_test"
PREFIX = "outboxkit:outbox"
COMMIT = dt.datetime(2026, 11, 23, tzinfo=dt.UTC)


@dataclass
class Emitted:
    prefix: str
    transactional: bool
    content: bytes


def _read_messages(dsn: str) -> list[Emitted]:
    """Consume the slot: every logical message of committed transactions, in commit order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Decoding reads only flushed WAL; the test server commits asynchronously.
        conn.execute("SET synchronous_commit = on")
        with conn.transaction():  # a commit that writes WAL waits for its flush (and all before)
            conn.execute("SELECT pg_logical_emit_message(true, 'test:flush', '')")
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL,"
            " 'proto_version', '1', 'publication_names', %s, 'messages', 'true')",
            (SLOT, PUBLICATION),
        ).fetchall()
    out: list[Emitted] = []
    for (data,) in rows:
        data = bytes(data)
        if data[:1] != b"M" or data[10:20] == b"test:flush":
            continue
        # pgoutput Message: 'M', int8 flags, int64 lsn, prefix\0, int32 length, content
        flags = data[1]
        end = data.index(b"\0", 10)
        prefix = data[10:end].decode()
        (length,) = struct.unpack_from(">i", data, end + 1)
        content = data[end + 5 : end + 5 + length]
        out.append(Emitted(prefix, bool(flags & 1), content))
    return out


@pytest.fixture
def wal_dsn(logical_db_dsn: str) -> Iterator[str]:
    """A fresh database on the logical server, with an empty slot to read messages from."""
    with psycopg.connect(logical_db_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE PUBLICATION {PUBLICATION}")  # messages need no table
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
    yield logical_db_dsn


def _events(n: int, tag: str) -> list[Event]:
    return [
        Event(
            topic="orders",
            event_type="order.placed",
            payload={"n": i, "tag": tag},
            key=f"k{i % 3}",
            aggregate_type="order",
            aggregate_id=str(i),
            headers={"x-tag": tag},
            schema_version=2,
        )
        for i in range(n)
    ]


def _assert_emitted(dsn: str, events: list[Event]) -> None:
    messages = _read_messages(dsn)
    assert [m.prefix for m in messages] == [PREFIX] * len(events)
    assert all(m.transactional for m in messages)
    decoded = [decode_envelope(m.content, commit_time=COMMIT) for m in messages]
    assert [d.event_id for d in decoded] == [e.event_id for e in events]  # in write order
    for d, e in zip(decoded, events, strict=True):
        assert (d.topic, d.key, d.event_type, d.aggregate_type, d.aggregate_id) == (
            e.topic,
            e.key,
            e.event_type,
            e.aggregate_type,
            e.aggregate_id,
        )
        assert (d.payload, d.headers, d.occurred_at, d.schema_version) == (
            e.payload,
            e.headers,
            e.occurred_at,
            e.schema_version,
        )
    with psycopg.connect(dsn) as conn:  # no row: the table is not written at all
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


# -- every API x driver ---------------------------------------------------------------

SyncWrite = Callable[[Outbox, Any, list[Event]], None]


def _put(outbox: Outbox, conn: Any, events: list[Event]) -> None:
    for e in events:
        outbox.put(conn, e)


def _put_many(outbox: Outbox, conn: Any, events: list[Event]) -> None:
    outbox.put_many(conn, events[:1])  # one event: the single-message statement
    outbox.put_many(conn, events[1:])


SYNC_WRITES: dict[str, SyncWrite] = {"put": _put, "put_many": _put_many}


@pytest.mark.parametrize("write", SYNC_WRITES)
@pytest.mark.parametrize("notify", [False, True])
def test_psycopg_writes_one_message_per_event(wal_dsn: str, write: str, notify: bool) -> None:
    outbox, events = Outbox(storage="wal", notify=notify), _events(4, write)
    with psycopg.connect(wal_dsn) as conn, conn.transaction():
        SYNC_WRITES[write](outbox, conn, events)
    _assert_emitted(wal_dsn, events)


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
@pytest.mark.parametrize("write", SYNC_WRITES)
def test_sqlalchemy_writes_one_message_per_event(wal_dsn: str, driver: str, write: str) -> None:
    outbox, events = Outbox(storage="wal"), _events(3, write)
    engine = sa.create_engine(wal_dsn.replace("postgresql://", f"postgresql+{driver}://"))
    try:
        with Session(engine) as session, session.begin():
            SYNC_WRITES[write](outbox, session, events)
        with engine.begin() as connection:  # a Connection, not a Session
            SYNC_WRITES[write](outbox, connection, events[:1])
    finally:
        engine.dispose()
    _assert_emitted(wal_dsn, [*events, events[0]])


AsyncWrite = Callable[[Outbox, Any, list[Event]], Awaitable[None]]


async def _aput(outbox: Outbox, conn: Any, events: list[Event]) -> None:
    for e in events:
        await outbox.aput(conn, e)


async def _aput_many(outbox: Outbox, conn: Any, events: list[Event]) -> None:
    await outbox.aput_many(conn, events[:1])
    await outbox.aput_many(conn, events[1:])


ASYNC_WRITES: dict[str, AsyncWrite] = {"aput": _aput, "aput_many": _aput_many}


@pytest.mark.parametrize("write", ASYNC_WRITES)
async def test_psycopg_async_writes_one_message_per_event(wal_dsn: str, write: str) -> None:
    outbox, events = Outbox(storage="wal"), _events(4, write)
    async with await psycopg.AsyncConnection.connect(wal_dsn) as conn, conn.transaction():
        await ASYNC_WRITES[write](outbox, conn, events)
    _assert_emitted(wal_dsn, events)


@pytest.mark.parametrize("write", ASYNC_WRITES)
async def test_asyncpg_writes_one_message_per_event(wal_dsn: str, write: str) -> None:
    outbox, events = Outbox(storage="wal", notify=True), _events(4, write)
    conn = await asyncpg.connect(wal_dsn)
    try:
        async with conn.transaction():
            await ASYNC_WRITES[write](outbox, conn, events)
    finally:
        await conn.close()
    _assert_emitted(wal_dsn, events)


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
@pytest.mark.parametrize("write", ASYNC_WRITES)
async def test_sqlalchemy_async_writes_one_message_per_event(
    wal_dsn: str, driver: str, write: str
) -> None:
    outbox, events = Outbox(storage="wal"), _events(3, write)
    engine = create_async_engine(wal_dsn.replace("postgresql://", f"postgresql+{driver}://"))
    try:
        async with AsyncSession(engine) as session, session.begin():
            await ASYNC_WRITES[write](outbox, session, events)
    finally:
        await engine.dispose()
    _assert_emitted(wal_dsn, events)


@pytest.mark.parametrize("prepare", [True, False])
def test_transaction_emits_with_the_commit(wal_dsn: str, prepare: bool) -> None:
    outbox = Outbox(storage="wal", notify=True)
    first, second = _events(3, "first"), _events(2, "second")
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        if not prepare:
            conn.prepare_threshold = None
        with outbox.transaction(conn) as tx:
            conn.execute("SELECT 1")
            tx.put(first[0])
            tx.put_many(first[1:])
        with outbox.transaction(conn) as tx:  # the prepared statement is reused
            tx.put_many(second)
        prepared = conn.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'outboxkit_emit_%%'"
        ).fetchone()
        assert prepared == ((2,) if prepare else (0,))  # with and without the NOTIFY
    _assert_emitted(wal_dsn, [*first, *second])


async def test_atransaction_emits_with_the_commit(wal_dsn: str) -> None:
    outbox, events = Outbox(storage="wal"), _events(3, "atx")
    async with await psycopg.AsyncConnection.connect(wal_dsn) as conn:
        async with outbox.atransaction(conn) as tx:
            tx.put_many(events)
    _assert_emitted(wal_dsn, events)


# -- execute_with: the messages run exactly once, with the caller's statement -------------


def test_execute_with_emits_once_whatever_the_statement_matches(wal_dsn: str) -> None:
    outbox = Outbox(storage="wal")
    one, many, none = _events(1, "one"), _events(3, "many"), _events(1, "none")
    with psycopg.connect(wal_dsn) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, state text)")
        conn.commit()
        with conn.transaction():
            cur = outbox.execute_with(
                conn,
                "INSERT INTO orders VALUES (%s, 'new'), (%s, 'new') RETURNING id",
                (1, 2),
                events=one,
            )
            assert sorted(r[0] for r in cur.fetchall()) == [1, 2]
            # a SELECT of several rows: still once per event, not once per row
            cur = outbox.execute_with(conn, "SELECT id FROM orders ORDER BY id", events=many)
            assert cur.fetchall() == [(1,), (2,)]
            # an UPDATE that matches nothing: the events are written all the same
            cur = outbox.execute_with(
                conn, "UPDATE orders SET state = %s WHERE id = %s", ("x", 99), events=none
            )
            assert cur.rowcount == 0
            outbox.execute_with(conn, "SELECT 1", events=[])  # no events: just the query
    _assert_emitted(wal_dsn, [*one, *many, *none])


async def test_aexecute_with_emits_once_psycopg_and_asyncpg(wal_dsn: str) -> None:
    outbox = Outbox(storage="wal")
    first, second = _events(2, "psycopg"), _events(2, "asyncpg")
    async with await psycopg.AsyncConnection.connect(wal_dsn) as conn, conn.transaction():
        cur = await outbox.aexecute_with(
            conn, "SELECT g FROM generate_series(1, %s) AS g", (3,), events=first
        )
        assert await cur.fetchall() == [(1,), (2,), (3,)]
    aconn = await asyncpg.connect(wal_dsn)
    try:
        async with aconn.transaction():
            rows = await outbox.aexecute_with(
                aconn, "SELECT g FROM generate_series(1, $1) AS g", (3,), events=second
            )
            assert [r[0] for r in rows] == [1, 2, 3]
    finally:
        await aconn.close()
    _assert_emitted(wal_dsn, [*first, *second])


def test_execute_with_joins_the_callers_with_list_and_notifies_once(wal_dsn: str) -> None:
    outbox, events = Outbox(storage="wal", notify=True), _events(3, "with")
    with psycopg.connect(wal_dsn, autocommit=True) as listener:
        listener.execute("LISTEN outboxkit_outbox")
        with psycopg.connect(wal_dsn) as conn, conn.transaction():
            cur = outbox.execute_with(
                conn, "WITH x AS (SELECT %s::int AS v) SELECT v FROM x", (7,), events=events
            )
            assert cur.fetchall() == [(7,)]
        got = list(listener.notifies(timeout=1.0, stop_after=2))
    assert [n.channel for n in got] == ["outboxkit_outbox"]
    _assert_emitted(wal_dsn, events)


def test_execute_with_needs_the_outbox_table_and_says_so(wal_dsn: str) -> None:
    """The messages ride in a zero-row INSERT into the table: it must exist (migrate)."""
    outbox = Outbox("missing_outbox", storage="wal")
    with psycopg.connect(wal_dsn) as conn:
        with pytest.raises(TableNotFoundError, match="missing_outbox"):
            outbox.execute_with(conn, "SELECT 1", events=_events(1, "x"))
        conn.rollback()
        with conn.transaction():  # put and transaction() need no table at all
            outbox.put(conn, _events(1, "x")[0])


def test_execute_with_a_failing_statement_emits_nothing(wal_dsn: str) -> None:
    outbox = Outbox(storage="wal")
    with psycopg.connect(wal_dsn) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero), conn.transaction():
            outbox.execute_with(conn, "SELECT 1 / 0", events=_events(1, "x"))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _read_messages(wal_dsn) == []


# -- what must emit nothing ---------------------------------------------------------------


class _Boom(Exception):
    pass


def test_a_rolled_back_transaction_emits_nothing_through_any_api(wal_dsn: str) -> None:
    outbox = Outbox(storage="wal", notify=True)
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        with pytest.raises(_Boom), conn.transaction():
            outbox.put(conn, _events(1, "put")[0])
            outbox.put_many(conn, _events(3, "put_many"))
            outbox.execute_with(conn, "SELECT 1", events=_events(2, "execute_with"))
            raise _Boom
        with pytest.raises(_Boom), outbox.transaction(conn) as tx:
            tx.put_many(_events(2, "transaction"))
            raise _Boom
        conn.execute("BEGIN")
        outbox.put(conn, _events(1, "explicit rollback")[0])
        conn.execute("ROLLBACK")
        committed = _events(1, "committed")
        with conn.transaction():
            outbox.put(conn, committed[0])
    _assert_emitted(wal_dsn, committed)  # only the committed transaction's event


def test_a_commit_that_fails_emits_nothing(wal_dsn: str) -> None:
    """The messages went out in the COMMIT's pipeline; the COMMIT itself fails: nothing."""
    outbox = Outbox(storage="wal")
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
        with pytest.raises(psycopg.errors.UniqueViolation), outbox.transaction(conn) as tx:
            conn.execute("INSERT INTO t VALUES (1), (1)")  # checked at COMMIT
            tx.put(_events(1, "x")[0])
    assert _read_messages(wal_dsn) == []


def test_writes_outside_a_transaction_are_refused_and_emit_nothing(wal_dsn: str) -> None:
    outbox = Outbox(storage="wal")
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransactionError, match="autocommit"):
            outbox.put(conn, _events(1, "x")[0])
        with pytest.raises(NotInTransactionError):
            outbox.put_many(conn, _events(2, "x"))
        with pytest.raises(NotInTransactionError):
            outbox.execute_with(conn, "SELECT 1", events=_events(1, "x"))
    assert _read_messages(wal_dsn) == []


async def test_async_writes_outside_a_transaction_are_refused(wal_dsn: str) -> None:
    outbox = Outbox(storage="wal")
    aconn = await asyncpg.connect(wal_dsn)
    try:
        with pytest.raises(NotInTransactionError, match="asyncpg"):
            await outbox.aput(aconn, _events(1, "x")[0])
        with pytest.raises(NotInTransactionError):
            await outbox.aexecute_with(aconn, "SELECT 1", events=_events(1, "x"))
    finally:
        await aconn.close()
    assert _read_messages(wal_dsn) == []


def test_a_bad_event_is_refused_before_anything_is_written(wal_dsn: str) -> None:
    outbox = Outbox(storage="wal", max_payload_bytes=100)
    good, big = _events(1, "good")[0], Event(topic="t", event_type="x", payload=b"x" * 101)
    with psycopg.connect(wal_dsn) as conn:
        with conn.transaction():  # each refusal leaves the transaction usable: nothing ran
            with pytest.raises(InvalidEventError, match="max_payload_bytes"):
                outbox.put_many(conn, [good, big])
            with pytest.raises(InvalidEventError, match="expected an outboxkit.Event"):
                outbox.put(conn, {"topic": "t"})  # type: ignore[arg-type]
            with pytest.raises(InvalidEventError):
                outbox.execute_with(conn, "SELECT 1", events=[good, big])
            with pytest.raises(TypeError, match="not a mapping"):
                outbox.execute_with(conn, "SELECT %(a)s", {"a": 1}, events=[good])
        with pytest.raises(InvalidEventError), outbox.transaction(conn) as tx:
            tx.put(good)
            tx.put(big)
    assert _read_messages(wal_dsn) == []


def test_notify_is_off_by_default_and_sent_once_when_asked(wal_dsn: str) -> None:
    with psycopg.connect(wal_dsn, autocommit=True) as listener:
        listener.execute("LISTEN outboxkit_outbox")
        for outbox in (Outbox(storage="wal"), Outbox(storage="wal", notify=True)):
            with psycopg.connect(wal_dsn) as conn, conn.transaction():
                outbox.put_many(conn, _events(3, "n"))
                outbox.put(conn, _events(1, "n")[0])
        got = list(listener.notifies(timeout=1.0, stop_after=2))
    assert [n.channel for n in got] == ["outboxkit_outbox"]  # only the notify=True outbox


def test_large_batches_keep_their_order(wal_dsn: str) -> None:
    outbox, events = Outbox(storage="wal"), _events(2000, "big")
    with psycopg.connect(wal_dsn) as conn, conn.transaction():
        outbox.put_many(conn, events)
    _assert_emitted(wal_dsn, events)


def test_scheduled_events_carry_their_time(wal_dsn: str) -> None:
    at = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    event = Event(topic="t", event_type="x", payload={}, deliver_at=at)
    with psycopg.connect(wal_dsn) as conn, conn.transaction():
        Outbox(storage="wal").put(conn, event)
    (message,) = _read_messages(wal_dsn)
    assert parse_envelope(message.content).deliver_at == at


def test_a_plain_role_can_write(wal_dsn: str) -> None:
    """pg_logical_emit_message needs no privilege: the application's own role will do."""
    with psycopg.connect(wal_dsn, autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS wal_writer")
        admin.execute("CREATE ROLE wal_writer LOGIN")
    try:
        events = _events(1, "role")
        with psycopg.connect(wal_dsn, user="wal_writer") as conn, conn.transaction():
            Outbox(storage="wal").put(conn, events[0])
        messages = _read_messages(wal_dsn)
        assert [parse_envelope(m.content).event_id for m in messages] == [events[0].event_id]
    finally:
        with psycopg.connect(wal_dsn, autocommit=True) as admin:
            admin.execute("DROP ROLE wal_writer")


def test_senseless_combinations_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="storage must be 'table'"):
        Outbox(storage="disk")
    with pytest.raises(ConfigurationError, match="commit order already"):
        Outbox(storage="wal", ordered=True)
    assert Outbox(storage="wal").notify is False
    assert Outbox().notify is True
    assert "storage='wal'" in repr(Outbox(storage="wal"))
