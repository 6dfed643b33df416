"""Outbox.transaction(): events written in the COMMIT's round trip, still atomic."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import psycopg
import pytest

from outboxkit import InvalidEventError, NotInTransactionError, Outbox
from outboxkit.backends.postgres.postgres import Statements
from outboxkit.errors import TableNotFoundError
from tests.integration.test_write import _client_round_trips, _event
from tests.integration.test_write import shop_dsn as shop_dsn  # the fixture, shared
from tests.support.relaying import count, rows


def _orders(dsn: str) -> int:
    return count(dsn, table="orders")


@pytest.mark.parametrize("autocommit", [True, False])
def test_events_put_in_an_outbox_transaction_commit_with_the_business_change(
    shop_dsn: str, autocommit: bool
) -> None:
    outbox = Outbox()
    first = _event(1)
    with psycopg.connect(shop_dsn, autocommit=autocommit) as conn:
        with outbox.transaction(conn) as tx:
            conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
            tx.put(first)
            tx.put_many([_event(2), _event(3)])
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _orders(shop_dsn) == 1
    stored = rows(shop_dsn)
    assert [json.loads(bytes(r["payload"]))["order"] for r in stored] == [1, 2, 3]
    row = stored[0]
    assert row["event_id"] == first.event_id
    assert (row["topic"], row["key"], row["event_type"]) == ("orders", "customer-1", "order.placed")
    assert (row["aggregate_type"], row["aggregate_id"]) == ("order", "1")
    assert [r["headers"] for r in stored] == [{"tenant": "acme"}] * 3
    assert (row["status"], row["attempts"]) == (0, 0)


@pytest.mark.parametrize("autocommit", [True, False])
def test_the_events_ride_the_commits_round_trip(shop_dsn: str, autocommit: bool) -> None:
    outbox = Outbox()
    with psycopg.connect(shop_dsn, autocommit=autocommit) as conn:

        def plain() -> None:
            with conn.transaction():
                conn.execute("INSERT INTO orders (customer) VALUES ('ada')")

        def with_events() -> None:
            with outbox.transaction(conn) as tx:
                conn.execute("INSERT INTO orders (customer) VALUES ('bob')")
                tx.put_many([_event(1), _event(2), _event(3)])

        with_events()  # the first use prepares the INSERT (in the same round trip)
        baseline = _client_round_trips(conn, plain)
        ours = _client_round_trips(conn, with_events)
    assert len(ours) == len(baseline), (ours, baseline)
    assert count(shop_dsn) == 6


def test_the_insert_is_prepared_once_per_connection_unless_prepare_threshold_is_none(
    shop_dsn: str,
) -> None:
    def parses(conn: psycopg.Connection[Any]) -> list[str]:
        import tempfile

        with tempfile.TemporaryFile("w+") as trace:
            conn.pgconn.trace(trace.fileno())
            conn.pgconn.set_trace_flags(
                psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE
            )
            try:
                with Outbox().transaction(conn) as tx:
                    tx.put(_event())
            finally:
                conn.pgconn.untrace()
            trace.seek(0)
            return [line for line in trace.read().splitlines() if "\tParse\t" in line]

    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        first, second = parses(conn), parses(conn)
    assert any("outboxkit_put_" in line for line in first)
    assert not any("INSERT" in line for line in second), "prepared: no Parse of the INSERT"
    with psycopg.connect(shop_dsn, autocommit=True, prepare_threshold=None) as conn:
        unnamed = parses(conn) + parses(conn)
    assert sum("INSERT" in line for line in unnamed) == 2, "parsed each time, nothing named"
    assert not any("outboxkit_put_" in line for line in unnamed)
    assert count(shop_dsn) == 4


def test_an_exception_in_the_block_rolls_back_and_sends_no_event(shop_dsn: str) -> None:
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        with pytest.raises(RuntimeError), Outbox().transaction(conn) as tx:
            conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
            tx.put(_event())
            raise RuntimeError("business rule failed after the put")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        conn.execute("SELECT 1")  # still usable
    assert _orders(shop_dsn) == 0
    assert count(shop_dsn) == 0


def test_a_failing_event_insert_rolls_the_business_change_back_and_raises(shop_dsn: str) -> None:
    """The naive way: commit, then write the event, and the order exists with no event.
    Here the INSERT runs before the COMMIT in the same pipeline: when it fails, nothing commits."""
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        with (
            pytest.raises(TableNotFoundError, match="outboxkit migrate.*was rolled back") as info,
            Outbox(table="missing").transaction(conn) as tx,
        ):
            conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
            tx.put(_event())
        assert isinstance(info.value.__cause__, psycopg.errors.UndefinedTable)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with Outbox().transaction(conn) as tx:  # the connection works on
            conn.execute("INSERT INTO orders (customer) VALUES ('bob')")
            tx.put(_event(2))
    assert _orders(shop_dsn) == 1
    assert count(shop_dsn) == 1


def test_invalid_event_raises_at_put_and_nothing_commits(shop_dsn: str) -> None:
    outbox = Outbox(max_payload_bytes=10)
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        with pytest.raises(InvalidEventError), outbox.transaction(conn) as tx:
            conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
            tx.put(_event(1))  # 11-byte payload
    assert _orders(shop_dsn) == 0
    assert count(shop_dsn) == 0


def test_misuse_is_refused(shop_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        with conn.transaction(), pytest.raises(NotInTransactionError, match=r"conn.transaction"):
            outbox.transaction(conn).__enter__()
        with conn.pipeline(), pytest.raises(NotInTransactionError, match="pipeline"):
            outbox.transaction(conn).__enter__()
        tx = outbox.transaction(conn)
        with pytest.raises(NotInTransactionError, match="not open"):
            tx.put(_event())
        with tx:
            pass
        with pytest.raises(NotInTransactionError, match="not open"):
            tx.put(_event())
    with pytest.raises(TypeError, match=r"psycopg.AsyncConnection"):
        outbox.atransaction(object()).__aenter__().send(None)  # type: ignore[arg-type]
    assert count(shop_dsn) == 0


def _isolation(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SHOW transaction_isolation").fetchone()
    assert row is not None
    return str(row[0])


def test_the_transaction_begins_with_the_connections_isolation_level(shop_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        with conn.transaction():
            assert _isolation(conn) == "serializable"  # what the application asked for
        conn.execute("BEGIN")  # a bare BEGIN (what the write sent before) ignores it
        assert _isolation(conn) == "read committed"
        conn.rollback()
        with outbox.transaction(conn) as tx:
            assert _isolation(conn) == "serializable"
            tx.put(_event(1))
    assert count(shop_dsn) == 1


async def test_the_async_transaction_begins_with_the_connections_isolation_level(
    shop_dsn: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(shop_dsn, autocommit=True) as conn:
        await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
        await conn.set_read_only(True)
        async with Outbox().atransaction(conn):
            cur = await conn.execute("SHOW transaction_isolation")
            assert await cur.fetchone() == ("repeatable read",)
            cur = await conn.execute("SHOW transaction_read_only")
            assert await cur.fetchone() == ("on",)


async def test_async_outbox_transaction_commits_and_rolls_back(shop_dsn: str) -> None:
    outbox = Outbox()
    async with await psycopg.AsyncConnection.connect(shop_dsn, autocommit=True) as conn:
        async with outbox.atransaction(conn) as tx:
            await conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
            tx.put(_event(1))
        with pytest.raises(RuntimeError):
            async with outbox.atransaction(conn) as tx:
                await conn.execute("INSERT INTO orders (customer) VALUES ('bob')")
                tx.put(_event(2))
                raise RuntimeError("rolled back")
        with pytest.raises(TableNotFoundError, match="was rolled back"):
            async with Outbox(table="missing").atransaction(conn) as tx:
                await conn.execute("INSERT INTO orders (customer) VALUES ('eve')")
                tx.put(_event(3))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _orders(shop_dsn) == 1
    assert [json.loads(bytes(r["payload"]))["order"] for r in rows(shop_dsn)] == [1]


async def test_asyncpg_is_pointed_to_put(shop_dsn: str) -> None:
    conn = await asyncpg.connect(shop_dsn)
    try:
        with pytest.raises(TypeError, match="aput"):
            async with Outbox().atransaction(conn):  # type: ignore[arg-type]
                pass
    finally:
        await conn.close()


def test_the_commit_notifies_an_idle_relay_once(shop_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(shop_dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {Statements(outbox.table).channel}")
        listener.execute(
            Statements(outbox.table).try_wake_lock
        )  # waits for work, as an idle relay does
        with psycopg.connect(shop_dsn, autocommit=True) as conn:
            with outbox.transaction(conn) as tx:
                tx.put_many([_event(1), _event(2)])
        got = list(listener.notifies(timeout=2.0, stop_after=2))
    assert len(got) == 1
