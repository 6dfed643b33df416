"""Outbox.defer(): events queued in a SQLAlchemy transaction, written with its COMMIT."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outboxkit import InvalidEventError, NotInTransactionError, Outbox
from outboxkit.errors import TableNotFoundError
from tests.integration.test_write import _client_round_trips, _event
from tests.integration.test_write import shop_dsn as shop_dsn  # the fixture, shared
from tests.support.relaying import count, rows

NEW_ORDER = sa.text("INSERT INTO orders (customer) VALUES (:c)")


def _url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://", 1)


def _orders(dsn: str) -> int:
    return count(dsn, table="orders")


def _payload_orders(dsn: str) -> list[int]:
    return [json.loads(bytes(r["payload"]))["order"] for r in rows(dsn)]


@pytest.fixture
def engine(shop_dsn: str) -> Iterator[sa.Engine]:
    e = sa.create_engine(_url(shop_dsn, "psycopg"), pool_size=1)
    yield e
    e.dispose()


@pytest.fixture(params=["psycopg", "asyncpg"])
async def aengine(request: pytest.FixtureRequest, shop_dsn: str) -> AsyncIterator[AsyncEngine]:
    e = create_async_engine(_url(shop_dsn, request.param), pool_size=1)
    yield e
    await e.dispose()


def test_deferred_events_commit_with_the_session(shop_dsn: str, engine: sa.Engine) -> None:
    outbox = Outbox()
    first = _event(1)
    with Session(engine) as session, session.begin():
        session.execute(NEW_ORDER, {"c": "ada"})
        outbox.defer(session, first)
        outbox.defer_many(session, [_event(2), _event(3)])
        assert count(shop_dsn) == 0  # not sent before the COMMIT
    assert _orders(shop_dsn) == 1
    assert _payload_orders(shop_dsn) == [1, 2, 3]
    assert rows(shop_dsn)[0]["event_id"] == first.event_id
    with Session(engine) as session, session.begin():  # the connection is clean for the next
        session.execute(NEW_ORDER, {"c": "bob"})
    assert (_orders(shop_dsn), count(shop_dsn)) == (2, 3)


def test_deferred_events_ride_the_commits_round_trip(shop_dsn: str, engine: sa.Engine) -> None:
    """Seen failing before defer() existed: put() costs one more Sync than the plain one."""
    outbox = Outbox()

    def plain() -> None:
        with Session(engine) as session, session.begin():
            session.execute(NEW_ORDER, {"c": "ada"})

    def with_events() -> None:
        with Session(engine) as session, session.begin():
            session.execute(NEW_ORDER, {"c": "bob"})
            outbox.defer_many(session, [_event(1), _event(2), _event(3)])

    with_events()  # prepares the INSERT on this (only) pooled connection
    with engine.connect() as c:
        raw = c.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    baseline = _client_round_trips(raw, plain)
    ours = _client_round_trips(raw, with_events)
    assert len(ours) == len(baseline), (ours, baseline)
    assert count(shop_dsn) == 6


def test_a_rollback_drops_the_deferred_events(shop_dsn: str, engine: sa.Engine) -> None:
    outbox = Outbox()
    with Session(engine) as session:
        with session.begin():
            session.execute(NEW_ORDER, {"c": "ada"})
            outbox.defer(session, _event(1))
            session.rollback()
        with pytest.raises(RuntimeError), session.begin():
            outbox.defer(session, _event(2))
            raise RuntimeError("the request failed")
        with session.begin():
            outbox.defer(session, _event(3))
    assert _payload_orders(shop_dsn) == [3]
    assert _orders(shop_dsn) == 0


def test_a_savepoint_rolled_back_drops_what_was_deferred_since(
    shop_dsn: str, engine: sa.Engine
) -> None:
    outbox = Outbox()
    with Session(engine) as session, session.begin():
        outbox.defer(session, _event(1))
        with pytest.raises(RuntimeError), session.begin_nested():
            outbox.defer(session, _event(2))
            with session.begin_nested():
                outbox.defer(session, _event(3))
            raise RuntimeError("inner work failed")
        with session.begin_nested():  # released: its events stay
            outbox.defer(session, _event(4))
            nested = session.begin_nested()
            outbox.defer(session, _event(5))
            nested.rollback()
        outbox.defer(session, _event(6))
    assert _payload_orders(shop_dsn) == [1, 4, 6]


def test_a_savepoint_taken_before_the_first_deferred_event_drops_them_all(
    shop_dsn: str, engine: sa.Engine
) -> None:
    outbox = Outbox()
    with Session(engine) as session, session.begin():
        nested = session.begin_nested()
        outbox.defer(session, _event(1))
        nested.rollback()
        outbox.defer(session, _event(2))
    assert _payload_orders(shop_dsn) == [2]


def test_a_connection_defers_too(shop_dsn: str, engine: sa.Engine) -> None:
    outbox = Outbox()
    with engine.begin() as conn:
        conn.execute(NEW_ORDER, {"c": "ada"})
        outbox.defer(conn, _event(1))
    with engine.connect() as conn:
        with conn.begin():
            outbox.defer(conn, _event(2))
            savepoint = conn.begin_nested()
            outbox.defer(conn, _event(3))
            savepoint.rollback()
        with conn.begin():
            outbox.defer(conn, _event(4))
            conn.rollback()
    assert _payload_orders(shop_dsn) == [1, 2]


def test_a_failing_event_insert_fails_the_commit_and_rolls_the_order_back(
    shop_dsn: str, engine: sa.Engine
) -> None:
    with psycopg.connect(shop_dsn, autocommit=True) as admin:
        admin.execute("ALTER TABLE outbox RENAME TO outbox_away")
    outbox = Outbox()
    with Session(engine) as session:
        with pytest.raises(TableNotFoundError), session.begin():
            session.execute(NEW_ORDER, {"c": "ada"})
            outbox.defer(session, _event(1))
        with session.begin():  # the session and its connection are usable again
            session.execute(NEW_ORDER, {"c": "bob"})
    assert _orders(shop_dsn) == 1


def test_misuse_is_refused(shop_dsn: str, engine: sa.Engine) -> None:
    outbox = Outbox()
    with Session(engine) as session:
        with pytest.raises(NotInTransactionError):
            outbox.defer(session, _event(1))
        with session.begin():
            with pytest.raises(InvalidEventError):
                outbox.defer(session, "not an event")  # type: ignore[arg-type]
            session.execute(NEW_ORDER, {"c": "ada"})
    with psycopg.connect(shop_dsn) as conn, pytest.raises(TypeError, match="transaction"):
        outbox.defer(conn, _event(1))  # type: ignore[arg-type]
    assert (count(shop_dsn), _orders(shop_dsn)) == (0, 1)


async def test_async_sessions_defer(shop_dsn: str, aengine: AsyncEngine) -> None:
    outbox = Outbox()
    async with AsyncSession(aengine) as session:
        async with session.begin():
            await session.execute(NEW_ORDER, {"c": "ada"})
            await outbox.adefer(session, _event(1))
            async with session.begin_nested():
                await outbox.adefer_many(session, [_event(2)])
            nested = await session.begin_nested()
            await outbox.adefer(session, _event(3))
            await nested.rollback()
            assert count(shop_dsn) == 0
        with pytest.raises(RuntimeError):
            async with session.begin():
                await session.execute(NEW_ORDER, {"c": "bob"})
                await outbox.adefer(session, _event(4))
                raise RuntimeError("the request failed")
    async with aengine.begin() as conn:
        await outbox.adefer(conn, _event(5))
    assert _orders(shop_dsn) == 1
    assert _payload_orders(shop_dsn) == [1, 2, 5]


async def test_an_async_failing_event_insert_fails_the_commit(
    shop_dsn: str, aengine: AsyncEngine
) -> None:
    with psycopg.connect(shop_dsn, autocommit=True) as admin:
        admin.execute("ALTER TABLE outbox RENAME TO outbox_away")
    outbox = Outbox()
    async with AsyncSession(aengine) as session:
        with pytest.raises(Exception) as raised:
            async with session.begin():
                await session.execute(NEW_ORDER, {"c": "ada"})
                await outbox.adefer(session, _event(1))
        assert "outbox" in str(raised.value)
        async with session.begin():
            await session.execute(NEW_ORDER, {"c": "bob"})
    assert _orders(shop_dsn) == 1


async def test_the_async_psycopg_commit_adds_no_round_trip(shop_dsn: str) -> None:
    engine = create_async_engine(_url(shop_dsn, "psycopg"), pool_size=1)
    outbox = Outbox()
    try:

        async def run(defer: bool) -> None:
            async with AsyncSession(engine) as session, session.begin():
                await session.execute(NEW_ORDER, {"c": "ada"})
                if defer:
                    await outbox.adefer(session, _event(1))

        await run(True)
        async with engine.connect() as c:
            raw: Any = (await c.get_raw_connection()).driver_connection
        counts = []
        for defer in (False, True):
            trace: list[str] = []

            async def work(defer: bool = defer) -> None:
                await run(defer)

            trace = await _async_round_trips(raw, work)
            counts.append(len(trace))
        assert counts[0] == counts[1], counts
    finally:
        await engine.dispose()


async def _async_round_trips(raw: Any, work: Any) -> list[str]:
    import tempfile

    from psycopg import pq

    with tempfile.TemporaryFile("w+") as trace:
        raw.pgconn.trace(trace.fileno())
        raw.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            await work()
        finally:
            raw.pgconn.untrace()
        trace.seek(0)
        lines = trace.read().splitlines()
    sent = [line.split("\t") for line in lines if line.startswith("F\t")]
    return [f[2].strip() for f in sent if f[2].strip() in ("Sync", "Query")]


def test_an_ordered_outbox_defers_too(shop_dsn: str, engine: sa.Engine) -> None:
    """The ordered write's key locks ride in the COMMIT's pipeline, as transaction()'s do."""
    outbox = Outbox(ordered=True)
    with Session(engine) as session, session.begin():
        outbox.defer_many(session, [_event(1), _event(2)])
    assert _payload_orders(shop_dsn) == [1, 2]


def test_a_two_phase_session_is_refused(shop_dsn: str, engine: sa.Engine) -> None:
    """Its COMMIT PREPARED fires no commit event: deferring there would lose the event."""
    with Session(engine, twophase=True) as session, session.begin():
        with pytest.raises(NotInTransactionError, match="two-phase"):
            Outbox().defer(session, _event(1))
        session.rollback()
