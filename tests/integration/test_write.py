"""The outbox write is atomic with the business change, through every adapter, or refused."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa
from psycopg import pq
from psycopg_pool import ConnectionPool
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outboxkit import Event, InvalidEventError, NotInTransactionError, Outbox
from outboxkit.backends.postgres.postgres import Statements
from tests.support.relaying import count, rows

ORDERS = "CREATE TABLE orders (id bigserial PRIMARY KEY, customer text NOT NULL)"


@pytest.fixture
def shop_dsn(db_dsn: str) -> Iterator[str]:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(ORDERS)
    yield db_dsn


def _event(i: int = 0) -> Event:
    return Event(
        topic="orders",
        event_type="order.placed",
        payload={"order": i},
        key=f"customer-{i % 3}",
        aggregate_type="order",
        aggregate_id=str(i),
        headers={"tenant": "acme"},
    )


def test_order_row_and_outbox_row_commit_together(shop_dsn: str) -> None:
    outbox = Outbox()
    event = _event(1)
    with psycopg.connect(shop_dsn) as conn, conn.transaction():
        conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
        outbox.put(conn, event)
    assert count(shop_dsn, table="orders") == 1
    [row] = rows(shop_dsn)
    assert row["event_id"] == event.event_id
    assert row["topic"] == "orders"
    assert row["key"] == "customer-1"
    assert row["event_type"] == "order.placed"
    assert (row["aggregate_type"], row["aggregate_id"]) == ("order", "1")
    assert bytes(row["payload"]) == b'{"order":1}'
    assert row["headers"] == {"tenant": "acme"}
    assert (row["status"], row["attempts"], row["claim_token"]) == (0, 0, None)


def test_rollback_after_put_leaves_neither_order_nor_event(shop_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(shop_dsn) as conn, pytest.raises(RuntimeError), conn.transaction():
        conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
        outbox.put(conn, _event())
        raise RuntimeError("business rule failed after the write")
    assert count(shop_dsn, table="orders") == 0
    assert count(shop_dsn) == 0


def test_put_many_keeps_the_order_of_the_events(shop_dsn: str) -> None:
    events = [_event(i) for i in range(250)]
    with psycopg.connect(shop_dsn) as conn, conn.transaction():
        Outbox().put_many(conn, events)
    assert [r["event_id"] for r in rows(shop_dsn)] == [e.event_id for e in events]


def _client_round_trips(conn: psycopg.Connection[Any], work: Callable[[], None]) -> list[str]:
    """The messages that end a client round trip (Sync, simple Query) while ``work`` runs."""
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            work()
        finally:
            conn.pgconn.untrace()
        trace.seek(0)
        lines = trace.read().splitlines()
    sent = [line.split("\t") for line in lines if line.startswith("F\t")]
    return [fields[2].strip() for fields in sent if fields[2].strip() in ("Sync", "Query")]


def test_put_many_is_one_round_trip_however_many_events(shop_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(shop_dsn) as conn, conn.transaction():
        sent = _client_round_trips(
            conn, lambda: outbox.put_many(conn, [_event(i) for i in range(1000)])
        )
    assert sent == ["Sync"]
    assert count(shop_dsn) == 1000


@pytest.mark.parametrize("autocommit", [True, False])
def test_put_in_pipeline_mode_rides_the_pipeline_and_stays_atomic(
    shop_dsn: str, autocommit: bool
) -> None:
    """In a pipelined transaction the INSERT is queued with the others: no round trip of its own."""
    outbox = Outbox()
    with psycopg.connect(shop_dsn, autocommit=autocommit) as conn:

        def pipelined(*events: Event) -> Callable[[], None]:
            def run() -> None:
                with conn.pipeline(), conn.transaction():
                    conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
                    if events:
                        outbox.put(conn, events[0])
                        outbox.put_many(conn, events[1:])

            return run

        without = _client_round_trips(conn, pipelined())
        with_events = _client_round_trips(conn, pipelined(_event(1), _event(2), _event(3)))
        with pytest.raises(RuntimeError), conn.pipeline(), conn.transaction():
            conn.execute("INSERT INTO orders (customer) VALUES ('bob')")
            outbox.put(conn, _event(4))
            raise RuntimeError("rolled back")
    assert with_events == without
    assert count(shop_dsn, table="orders") == 2
    assert [json.loads(bytes(r["payload"]))["order"] for r in rows(shop_dsn)] == [1, 2, 3]


def test_pipeline_mode_without_a_transaction_is_refused(shop_dsn: str) -> None:
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        with conn.pipeline():
            conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
            with pytest.raises(NotInTransactionError, match="autocommit"):
                Outbox().put(conn, _event(1))
    assert count(shop_dsn) == 0


def test_one_outbox_writes_through_many_connections_and_threads(shop_dsn: str) -> None:
    """The reused cursor follows the connection: each event lands in its own transaction."""
    outbox = Outbox(notify=False)
    with psycopg.connect(shop_dsn) as a, psycopg.connect(shop_dsn) as b:
        with a.transaction(), b.transaction():
            outbox.put(a, _event(1))
            outbox.put(b, _event(2))
            outbox.put(a, _event(3))
            b.execute("SELECT 1")  # b's transaction stays open until the with exits
        with pytest.raises(RuntimeError), a.transaction():
            outbox.put(a, _event(4))
            raise RuntimeError("rolled back")
    orders = [json.loads(bytes(r["payload"]))["order"] for r in rows(shop_dsn)]
    assert sorted(orders) == [1, 2, 3]

    def writer(first: int) -> None:
        with psycopg.connect(shop_dsn) as conn:
            for i in range(first, first + 50):
                with conn.transaction():
                    outbox.put(conn, _event(i))

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(writer, [100, 200, 300, 400]))
    orders = [json.loads(bytes(r["payload"]))["order"] for r in rows(shop_dsn)]
    assert sorted(orders) == [
        1,
        2,
        3,
        *range(100, 150),
        *range(200, 250),
        *range(300, 350),
        *range(400, 450),
    ]


def test_a_closed_connection_is_refused_after_it_was_written_through(shop_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(shop_dsn) as conn, conn.transaction():
        outbox.put(conn, _event(1))
    with pytest.raises(NotInTransactionError, match="closed"):
        outbox.put(conn, _event(2))
    assert count(shop_dsn) == 1


def test_an_empty_put_many_is_a_no_op(shop_dsn: str) -> None:
    with psycopg.connect(shop_dsn) as conn, conn.transaction():
        Outbox().put_many(conn, [])
    assert count(shop_dsn) == 0


# -- refusing to write outside a transaction ----------------------------------------


def test_autocommit_connection_is_refused_and_nothing_is_written(shop_dsn: str) -> None:
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransactionError, match="autocommit"):
            Outbox().put(conn, _event())
        with pytest.raises(NotInTransactionError):
            Outbox().put_many(conn, [_event(1), _event(2)])
    assert count(shop_dsn) == 0


def test_autocommit_connection_inside_an_explicit_transaction_is_accepted(shop_dsn: str) -> None:
    with psycopg.connect(shop_dsn, autocommit=True) as conn, conn.transaction():
        Outbox().put(conn, _event())
    assert count(shop_dsn) == 1


def test_closed_and_failed_transactions_are_refused(shop_dsn: str) -> None:
    conn = psycopg.connect(shop_dsn)
    conn.close()
    with pytest.raises(NotInTransactionError, match="closed"):
        Outbox().put(conn, _event())
    with psycopg.connect(shop_dsn) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(NotInTransactionError, match="already failed"):
            Outbox().put(conn, _event())
    assert count(shop_dsn) == 0


def test_a_pool_is_refused(shop_dsn: str) -> None:
    with ConnectionPool(shop_dsn, min_size=1, max_size=1, open=True) as pool:
        with pytest.raises(NotInTransactionError, match="pool"):
            Outbox().put(pool, _event())
    assert count(shop_dsn) == 0


def test_sqlalchemy_session_without_a_transaction_is_refused(shop_dsn: str) -> None:
    engine = sa.create_engine(shop_dsn.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with Session(engine) as session:
            with pytest.raises(NotInTransactionError, match=r"session.begin\(\)"):
                Outbox().put(session, _event())
        with engine.connect() as conn:
            autocommit = conn.execution_options(isolation_level="AUTOCOMMIT")
            # begin() is a no-op under AUTOCOMMIT: each statement would commit alone
            with autocommit.begin(), pytest.raises(NotInTransactionError, match="AUTOCOMMIT"):
                Outbox().put(autocommit, _event())
        with pytest.raises(NotInTransactionError, match="Engine"):
            Outbox().put(engine, _event())
    finally:
        engine.dispose()
    assert count(shop_dsn) == 0


async def test_asyncpg_without_a_transaction_is_refused(shop_dsn: str) -> None:
    conn = await asyncpg.connect(shop_dsn)
    try:
        with pytest.raises(NotInTransactionError, match="transaction"):
            await Outbox().aput(conn, _event())
    finally:
        await conn.close()
    assert count(shop_dsn) == 0


def test_a_sync_call_with_an_async_connection_says_which_method_to_use(shop_dsn: str) -> None:
    class NotAConnection:
        pass

    with pytest.raises(TypeError, match="expected psycopg.Connection"):
        Outbox().put(NotAConnection(), _event())


def test_invalid_event_raises_before_anything_reaches_the_database(shop_dsn: str) -> None:
    outbox = Outbox(max_payload_bytes=100)
    with psycopg.connect(shop_dsn) as conn, conn.transaction():
        conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
        with pytest.raises(InvalidEventError, match="max_payload_bytes=100"):
            outbox.put(conn, Event(topic="t", event_type="x", payload=b"x" * 101))
        with pytest.raises(InvalidEventError, match="expected an outboxkit.Event"):
            outbox.put(conn, {"topic": "t"})  # type: ignore[arg-type]
        with pytest.raises(InvalidEventError):
            outbox.put_many(conn, [_event(1), Event(topic="t", event_type="x", payload=b"y" * 500)])
        # The transaction is still healthy: validation happened client-side.
        conn.execute("SELECT 1")
    assert count(shop_dsn) == 0
    assert count(shop_dsn, table="orders") == 1


# -- every adapter ------------------------------------------------------------------


def test_psycopg_sync_adapter(shop_dsn: str) -> None:
    with psycopg.connect(shop_dsn) as conn, conn.transaction():
        Outbox().put(conn, _event(1))
        Outbox().put_many(conn, [_event(2), _event(3)])
    assert count(shop_dsn) == 3


async def test_psycopg_async_adapter(shop_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(shop_dsn) as conn, conn.transaction():
        await Outbox().aput(conn, _event(1))
        await Outbox().aput_many(conn, [_event(2), _event(3)])
    assert count(shop_dsn) == 3


async def test_asyncpg_adapter(shop_dsn: str) -> None:
    conn = await asyncpg.connect(shop_dsn)
    try:
        async with conn.transaction():
            await conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
            await Outbox().aput(conn, _event(1))
            await Outbox().aput_many(conn, [_event(2), _event(3)])
    finally:
        await conn.close()
    stored = rows(shop_dsn)
    assert len(stored) == 3
    assert stored[0]["headers"] == {"tenant": "acme"}
    assert bytes(stored[0]["payload"]) == b'{"order":1}'


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_sqlalchemy_session_and_connection_adapters(shop_dsn: str, driver: str) -> None:
    if driver == "psycopg2":
        pytest.importorskip("psycopg2", reason="psycopg2 is optional")
    engine = sa.create_engine(shop_dsn.replace("postgresql://", f"postgresql+{driver}://"))
    try:
        with Session(engine) as session, session.begin():
            session.execute(sa.text("INSERT INTO orders (customer) VALUES ('ada')"))
            Outbox().put(session, _event(1))
            Outbox().put_many(session, [_event(2), _event(3)])
        with engine.begin() as conn:
            Outbox().put(conn, _event(4))
        with Session(engine) as session, pytest.raises(RuntimeError), session.begin():
            Outbox().put(session, _event(5))
            raise RuntimeError("rolled back")
    finally:
        engine.dispose()
    stored = rows(shop_dsn)
    assert [json.loads(bytes(r["payload"]))["order"] for r in stored] == [1, 2, 3, 4]


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_sqlalchemy_async_session_and_connection_adapters(shop_dsn: str, driver: str) -> None:
    engine = create_async_engine(shop_dsn.replace("postgresql://", f"postgresql+{driver}://"))
    try:
        async with AsyncSession(engine) as session, session.begin():
            # the asyncpg dialect begins lazily: the outbox write must still be inside it
            await Outbox().aput(session, _event(1))
            await session.execute(sa.text("INSERT INTO orders (customer) VALUES ('ada')"))
            await Outbox().aput_many(session, [_event(2), _event(3)])
        async with engine.begin() as conn:
            await Outbox().aput(conn, _event(4))
        async with AsyncSession(engine) as session:
            with pytest.raises(NotInTransactionError):
                await Outbox().aput(session, _event(9))
            with pytest.raises(RuntimeError):
                async with session.begin():
                    await Outbox().aput(session, _event(5))
                    raise RuntimeError("rolled back")
    finally:
        await engine.dispose()
    stored = rows(shop_dsn)
    assert [json.loads(bytes(r["payload"]))["order"] for r in stored] == [1, 2, 3, 4]


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_sqlalchemy_async_write_after_other_statements_commits_and_rolls_back_with_them(
    shop_dsn: str, driver: str
) -> None:
    """Once the session's transaction has begun, the INSERT goes straight to the driver."""
    engine = create_async_engine(shop_dsn.replace("postgresql://", f"postgresql+{driver}://"))
    try:
        async with AsyncSession(engine) as session, session.begin():
            await session.execute(sa.text("INSERT INTO orders (customer) VALUES ('ada')"))
            await Outbox().aput(session, _event(1))
        async with AsyncSession(engine) as session:
            with pytest.raises(RuntimeError):
                async with session.begin():
                    await session.execute(sa.text("INSERT INTO orders (customer) VALUES ('bob')"))
                    await Outbox().aput(session, _event(2))
                    await Outbox().aput_many(session, [_event(3)])
                    raise RuntimeError("rolled back")
    finally:
        await engine.dispose()
    assert count(shop_dsn, table="orders") == 1
    assert [json.loads(bytes(r["payload"]))["order"] for r in rows(shop_dsn)] == [1]


def test_sqlalchemy_session_write_commits_and_rolls_back_with_the_session(shop_dsn: str) -> None:
    engine = sa.create_engine(shop_dsn.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with Session(engine) as session, pytest.raises(RuntimeError), session.begin():
            Outbox().put(session, _event(1))  # the first statement of the transaction
            session.execute(sa.text("INSERT INTO orders (customer) VALUES ('ada')"))
            raise RuntimeError("rolled back")
        with Session(engine) as session, session.begin():
            Outbox().put(session, _event(2))
            session.execute(sa.text("INSERT INTO orders (customer) VALUES ('bob')"))
    finally:
        engine.dispose()
    assert count(shop_dsn, table="orders") == 1
    assert [json.loads(bytes(r["payload"]))["order"] for r in rows(shop_dsn)] == [2]


# -- events in the caller's own statement --------------------------------------------


def test_execute_with_writes_the_events_in_the_callers_statement(shop_dsn: str) -> None:
    outbox = Outbox()
    first, second = _event(1), _event(2)
    with psycopg.connect(shop_dsn) as listener:
        listener.execute(f"LISTEN {Statements('outbox').channel}")
        listener.execute(Statements("outbox").try_wake_lock)  # waits for work, as a relay does
        listener.commit()
        with psycopg.connect(shop_dsn) as conn:
            with conn.transaction():  # BEGIN is sent here, before the trace starts
                cursors: list[psycopg.Cursor[Any]] = []
                sent = _client_round_trips(
                    conn,
                    lambda: cursors.append(
                        outbox.execute_with(
                            conn,
                            "INSERT INTO orders (customer) VALUES (%s) RETURNING id, customer",
                            ("ada",),
                            events=[first],
                        )
                    ),
                )
                assert cursors[0].fetchone() == (1, "ada")
                outbox.execute_with(
                    conn,
                    "UPDATE orders SET customer = %s WHERE id = %s",
                    ("eve", 1),
                    events=[second],
                )
        notes = list(listener.notifies(timeout=10, stop_after=1))
    assert sent == ["Sync"]
    assert [n.channel for n in notes] == [Statements("outbox").channel]
    stored = rows(shop_dsn)
    assert [r["event_id"] for r in stored] == [first.event_id, second.event_id]
    assert stored[0]["key"] == "customer-1"
    assert (stored[0]["aggregate_type"], stored[0]["aggregate_id"]) == ("order", "1")
    assert bytes(stored[0]["payload"]) == b'{"order":1}'
    assert stored[0]["headers"] == {"tenant": "acme"}


def test_execute_with_rolls_back_with_the_transaction(shop_dsn: str) -> None:
    outbox = Outbox(notify=False)
    with psycopg.connect(shop_dsn) as conn, pytest.raises(RuntimeError), conn.transaction():
        outbox.execute_with(
            conn, "INSERT INTO orders (customer) VALUES (%s)", ("ada",), events=[_event(1)]
        )
        raise RuntimeError("rolled back")
    assert count(shop_dsn, table="orders") == 0
    assert count(shop_dsn) == 0


def test_execute_with_writes_the_events_even_when_the_statement_matches_nothing(
    shop_dsn: str,
) -> None:
    with psycopg.connect(shop_dsn) as conn, conn.transaction():
        cur = Outbox().execute_with(
            conn,
            "UPDATE orders SET customer = %s WHERE id = %s",
            ("eve", 42),
            events=[_event(1), _event(2)],
        )
        assert cur.rowcount == 0
    assert count(shop_dsn) == 2


def test_execute_with_merges_into_the_statements_own_with_list(shop_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(shop_dsn) as conn, conn.transaction():
        cur = outbox.execute_with(
            conn,
            "with recursive n(i) AS (SELECT %s::int UNION ALL SELECT i + 1 FROM n WHERE i < %s)"
            " INSERT INTO orders (customer) SELECT 'c' || i FROM n RETURNING customer",
            (1, 3),
            events=[_event(1), _event(2), _event(3)],
        )
        assert [r[0] for r in cur.fetchall()] == ["c1", "c2", "c3"]
    assert count(shop_dsn, table="orders") == 3
    assert count(shop_dsn) == 3


def test_execute_with_refuses_what_put_refuses_and_runs_nothing(shop_dsn: str) -> None:
    outbox = Outbox()
    insert = "INSERT INTO orders (customer) VALUES (%s)"
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransactionError, match="autocommit"):
            outbox.execute_with(conn, insert, ("ada",), events=[_event(1)])
        with pytest.raises(TypeError, match="positional"):
            outbox.execute_with(conn, insert, {"c": "ada"}, events=[_event(1)])  # type: ignore[arg-type]
        with pytest.raises(InvalidEventError):
            outbox.execute_with(conn, insert, ("ada",), events=[{"topic": "t"}])  # type: ignore[list-item]
    engine = sa.create_engine(shop_dsn.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with Session(engine) as session, session.begin():
            with pytest.raises(TypeError, match="put"):
                outbox.execute_with(session, insert, ("ada",), events=[_event(1)])  # type: ignore[arg-type]
    finally:
        engine.dispose()
    assert count(shop_dsn, table="orders") == 0
    assert count(shop_dsn) == 0


async def test_aexecute_with_on_psycopg_async(shop_dsn: str) -> None:
    outbox = Outbox()
    async with await psycopg.AsyncConnection.connect(shop_dsn) as conn:
        async with conn.transaction():
            cur = await outbox.aexecute_with(
                conn,
                "INSERT INTO orders (customer) VALUES (%s) RETURNING id",
                ("ada",),
                events=[_event(1)],
            )
            assert await cur.fetchone() == (1,)
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await outbox.aexecute_with(conn, "SELECT %s", (1,), events=[_event(2)])
                raise RuntimeError("rolled back")
    assert count(shop_dsn, table="orders") == 1
    assert [json.loads(bytes(r["payload"]))["order"] for r in rows(shop_dsn)] == [1]


async def test_aexecute_with_on_asyncpg_numbers_the_events_after_the_callers_parameters(
    shop_dsn: str,
) -> None:
    outbox = Outbox()
    conn = await asyncpg.connect(shop_dsn)
    try:
        with pytest.raises(NotInTransactionError, match="transaction"):
            await outbox.aexecute_with(conn, "SELECT $1::int", (1,), events=[_event(9)])
        async with conn.transaction():
            rows_back = await outbox.aexecute_with(
                conn,
                "INSERT INTO orders (customer) VALUES ($1), ($2) RETURNING id, customer",
                ("ada", "bob"),
                events=[_event(1)],
            )
            assert [tuple(r) for r in rows_back] == [(1, "ada"), (2, "bob")]
            assert (
                await outbox.aexecute_with(
                    conn,
                    "WITH gone AS (DELETE FROM orders WHERE customer = $1 RETURNING id)"
                    " SELECT count(*) FROM gone",
                    ("bob",),
                    events=[_event(2), _event(3)],
                )
            )[0][0] == 1
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await outbox.aexecute_with(
                    conn, "INSERT INTO orders (customer) VALUES ($1)", ("eve",), events=[_event(4)]
                )
                raise RuntimeError("rolled back")
    finally:
        await conn.close()
    assert [r["customer"] for r in _orders(shop_dsn)] == ["ada"]
    assert [json.loads(bytes(r["payload"]))["order"] for r in rows(shop_dsn)] == [1, 2, 3]


def _orders(dsn: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        return cur.execute("SELECT id, customer FROM orders ORDER BY id").fetchall()
