"""outboxkit behind PgBouncer in transaction pooling mode (Debian's 1.18 on these machines).

Transaction pooling hands each transaction whichever server connection is free: session
state (prepared statements before 1.21, session advisory locks, LISTEN) does not follow
the client. Every test here talks to PostgreSQL only through a real PgBouncer, and checks
what reached the broker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outboxkit import Event, Outbox
from outboxkit.publishers.nats import NatsPublisher
from tests.support.pgbouncer import PgBouncer
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events
from tests.support.servers import consume_nats, ensure_stream, unique_name


def _event(topic: str = "orders", n: int = 0) -> Event:
    return Event(topic=topic, event_type="order.placed", payload={"n": n}, key=f"k{n % 3}")


@contextlib.contextmanager
def _two(dsn: str, **options: Any) -> Iterator[tuple[psycopg.Connection[Any], ...]]:
    with psycopg.connect(dsn, **options) as a, psycopg.connect(dsn, **options) as b:
        yield a, b


@pytest.fixture
def pooled_dsn(db_dsn: str, pgbouncer: PgBouncer) -> str:
    """The test's database through the transaction pooler."""
    return pgbouncer.dsn_for(psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"])


async def _stream(nats_server: Any) -> tuple[str, str]:
    root = unique_name("pgb")
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    return root, root.upper()


async def test_the_relay_behind_pgbouncer_publishes_the_whole_backlog(
    db_dsn: str, pooled_dsn: str, nats_server: Any
) -> None:
    """PgBouncer 1.18 keeps no prepared statement across transactions: psycopg's automatic
    ones (prepare_threshold=5) broke every claim after the first few batches."""
    root, stream = await _stream(nats_server)
    events = make_events(f"{root}.orders", 300)
    for i in range(0, 300, 30):  # several claims, each statement run more than 5 times
        write_events(pooled_dsn, events[i : i + 30])
    async with running_relay(
        pooled_dsn, NatsPublisher.from_url(nats_server.url), batch_size=10, max_in_flight=2
    ):
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the backlog to drain")
    msgs = await consume_nats(nats_server.url, stream, f"{root}.>", None)
    ids = {m.headers["Nats-Msg-Id"] for m in msgs}
    assert ids == {str(e.event_id) for e in events}


# -- the write side ---------------------------------------------------------------------
# Two clients whose transactions overlap, the outer one alternating: PgBouncer hands each
# transaction the server connection released last, so each client's transactions run on
# one server connection, then the other.


def test_transaction_writes_through_pgbouncer_on_default_psycopg_connections(
    db_dsn: str, pooled_dsn: str
) -> None:
    """transaction() prepared its INSERT at the first commit of a connection; behind
    PgBouncer 1.18 the next commit on another server connection failed with `prepared
    statement "outboxkit_put_..." does not exist`. It now finds the pooler and prepares none."""
    outbox = Outbox()
    with _two(pooled_dsn) as (a, b):
        for i in range(8):
            outer, inner = (a, b) if i % 2 else (b, a)
            with outbox.transaction(outer) as t1:
                outer.execute("SELECT 1")  # holds a server connection
                t1.put(_event(n=i))
                with outbox.transaction(inner) as t2:
                    inner.execute("SELECT 1")
                    t2.put_many([_event(n=i), _event(n=i + 1)])
    assert count(db_dsn) == 24


async def test_atransaction_writes_through_pgbouncer(db_dsn: str, pooled_dsn: str) -> None:
    outbox = Outbox()
    async with (
        await psycopg.AsyncConnection.connect(pooled_dsn) as a,
        await psycopg.AsyncConnection.connect(pooled_dsn) as b,
    ):
        for i in range(8):
            outer, inner = (a, b) if i % 2 else (b, a)
            async with outbox.atransaction(outer) as t1:
                await outer.execute("SELECT 1")
                t1.put(_event(n=i))
                async with outbox.atransaction(inner) as t2:
                    await inner.execute("SELECT 1")
                    t2.put(_event(n=i))
    assert count(db_dsn) == 16


def test_put_and_put_many_write_through_pgbouncer(db_dsn: str, pooled_dsn: str) -> None:
    """psycopg behind PgBouncer < 1.21 needs prepare_threshold=None for every statement
    (psycopg's own advice): put() and put_many() then work as they do elsewhere."""
    outbox = Outbox()
    with _two(pooled_dsn, prepare_threshold=None) as (a, b):
        for i in range(8):
            outer, inner = (a, b) if i % 2 else (b, a)
            with outer.transaction():
                outer.execute("SELECT 1")
                outbox.put(outer, _event(n=i))
                with inner.transaction():
                    outbox.put_many(inner, [_event(n=i), _event(n=i + 1)])
    assert count(db_dsn) == 24


async def test_asyncpg_writes_through_pgbouncer(db_dsn: str, pooled_dsn: str) -> None:
    """asyncpg behind PgBouncer < 1.21: statement_cache_size=0 (asyncpg's own advice)."""
    dsn = pooled_dsn_url(pooled_dsn)
    outbox = Outbox()
    a = await asyncpg.connect(dsn, statement_cache_size=0)
    b = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        for i in range(8):
            outer, inner = (a, b) if i % 2 else (b, a)
            async with outer.transaction():
                await outer.execute("SELECT 1")
                await outbox.aput(outer, _event(n=i))
                async with inner.transaction():
                    await outbox.aput_many(inner, [_event(n=i), _event(n=i + 1)])
    finally:
        await a.close()
        await b.close()
    assert count(db_dsn) == 24


async def test_sqlalchemy_sessions_write_through_pgbouncer(db_dsn: str, pooled_dsn: str) -> None:
    url = pooled_dsn_url(pooled_dsn).replace("postgresql://", "postgresql+psycopg://")
    outbox = Outbox()
    engine = sa.create_engine(url, connect_args={"prepare_threshold": None})
    aengine = create_async_engine(url, connect_args={"prepare_threshold": None})
    try:
        for i in range(6):
            with Session(engine) as session, session.begin():
                session.execute(sa.text("SELECT 1"))
                outbox.put(session, _event(n=i))
                async with AsyncSession(aengine) as asession, asession.begin():
                    await outbox.aput_many(asession, [_event(n=i), _event(n=i + 1)])
    finally:
        engine.dispose()
        await aengine.dispose()
    assert count(db_dsn) == 18


def pooled_dsn_url(dsn: str) -> str:
    """The key=value DSN as a URL (asyncpg and SQLAlchemy take URLs)."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    return f"postgresql://{info['user']}@{info['host']}:{info['port']}/{info['dbname']}"
