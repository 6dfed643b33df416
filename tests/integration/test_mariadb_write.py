"""`Outbox(storage="mariadb")` on the private MariaDB: events commit and roll back with the
caller's transaction through every driver (PyMySQL, mysqlclient, aiomysql, asyncmy and
SQLAlchemy 2 on each), and a write outside a transaction, or bad input, is refused as on
PostgreSQL, with nothing written."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from outboxkit import Event, InvalidEventError, Outbox, TableNotFoundError
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.queue import MariaDBQueueStore
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import ConfigurationError, NotInTransactionError, StoreUnavailable
from outboxkit.publishers.base import OutboundMessage
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import (
    ASYNC,
    SYNC,
    Driver,
    database,
    driver_module,
    outbox_topics,
)


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    with database(mariadb_server, "w", migrate) as url:
        yield url


def _connect(url: str, **options: Any) -> Any:
    return pymysql.connect(**connect_args(url), **options)


def _topics(url: str) -> list[str]:
    return outbox_topics(url)


def _event(topic: str, **extra: Any) -> Event:
    return Event(topic=topic, event_type="order.placed", payload={"id": 7}, **extra)


def test_put_commits_and_rolls_back_with_the_callers_transaction(url: str) -> None:
    outbox = Outbox(storage="mariadb")
    conn = _connect(url)  # PyMySQL's default: autocommit off, a transaction per unit
    try:
        outbox.put(conn, _event("kept"))
        conn.commit()
        outbox.put(conn, _event("rolled.back"))
        conn.rollback()
        conn.begin()
        outbox.put_many(conn, [_event(f"many.{i}") for i in range(3)])
        conn.commit()
    finally:
        conn.close()
    assert _topics(url) == ["kept", "many.0", "many.1", "many.2"]


def test_put_on_an_autocommit_connection_is_refused_and_writes_nothing(url: str) -> None:
    outbox = Outbox(storage="mariadb")
    conn = _connect(url, autocommit=True)
    try:
        with pytest.raises(NotInTransactionError, match="autocommit"):
            outbox.put(conn, _event("lonely"))
        conn.begin()  # an explicit transaction on the same connection is fine
        outbox.put(conn, _event("in.tx"))
        conn.commit()
    finally:
        conn.close()
    assert _topics(url) == ["in.tx"]


def test_what_mariadb_cannot_do_is_refused_at_construction_in_one_line() -> None:
    # (ordered=True is MariaDB's too: tests/integration/test_mariadb_ordered_write.py)
    with pytest.raises(ConfigurationError, match="no LISTEN/NOTIFY") as refused:
        Outbox(storage="mariadb", notify=True)
    assert "\n" not in str(refused.value)
    assert Outbox(storage="mariadb").notify is False


# -- every driver -----------------------------------------------------------------------------


@pytest.mark.parametrize("driver", SYNC, ids=str)
def test_every_sync_driver_writes_with_the_transaction_and_not_without(
    url: str, driver: Driver
) -> None:
    outbox, args = Outbox(), connect_args(url)  # the connection picks MariaDB's table
    with driver.transaction(args, url) as conn:
        outbox.put(conn, _event("one"))
        outbox.put_many(conn, [_event("two"), _event("three", key="k")])
    with pytest.raises(RuntimeError, match="business failure"):
        with driver.transaction(args, url) as conn:
            outbox.put_many(conn, [_event("rolled.back")])
            raise RuntimeError("business failure")
    with driver.transaction(args, url) as conn:  # bad input: refused, the transaction intact
        with pytest.raises(InvalidEventError, match="max_payload_bytes=10"):
            Outbox(max_payload_bytes=10).put(
                conn, Event(topic="t", event_type="x", payload=b"x" * 11)
            )
        with pytest.raises(InvalidEventError, match="expected an outboxkit.Event"):
            outbox.put_many(conn, [_event("never"), {"topic": "t"}])  # type: ignore[list-item]
        outbox.put(conn, _event("after.bad.input"))
    assert _topics(url) == ["one", "two", "three", "after.bad.input"]


@pytest.mark.parametrize("driver", ASYNC, ids=str)
async def test_every_async_driver_writes_with_the_transaction_and_not_without(
    url: str, driver: Driver
) -> None:
    outbox, args = Outbox(), connect_args(url)  # the connection picks MariaDB's table
    payload = bytes(range(256))  # every byte value survives the driver's quoting
    async with driver.transaction(args, url) as conn:
        await outbox.aput(conn, Event(topic="one", event_type="x", payload=payload))
        await outbox.aput_many(conn, [_event("two"), _event("three")])
    with pytest.raises(RuntimeError, match="business failure"):
        async with driver.transaction(args, url) as conn:
            await outbox.aput(conn, _event("rolled.back"))
            raise RuntimeError("business failure")
    async with driver.transaction(args, url) as conn:
        with pytest.raises(InvalidEventError):
            await outbox.aput_many(conn, [_event("never"), object()])  # type: ignore[list-item]
    assert _topics(url) == ["one", "two", "three"]
    conn = _connect(url, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT payload FROM outbox WHERE topic = 'one'")
            assert cur.fetchone() == (payload,)
    finally:
        conn.close()


def test_every_refusal_outside_a_transaction_is_postgresqls(url: str) -> None:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session, sessionmaker

    outbox, args = Outbox(storage="mariadb"), connect_args(url)
    mysqldb = driver_module("MySQLdb").connect(**args, autocommit=True)
    try:
        with pytest.raises(NotInTransactionError, match="autocommit mode"):
            outbox.put(mysqldb, _event("lonely"))
        mysqldb.begin()  # an explicit transaction on an autocommit connection is one
        outbox.put(mysqldb, _event("explicit.begin"))
        mysqldb.commit()
    finally:
        mysqldb.close()
    with pytest.raises(NotInTransactionError, match="closed"):
        outbox.put(mysqldb, _event("closed"))
    engine = sa.create_engine(url.replace("mysql://", "mysql+pymysql://"))
    try:
        with pytest.raises(NotInTransactionError, match="Engine"):
            outbox.put(engine, _event("engine"))  # type: ignore[arg-type]
        with pytest.raises(NotInTransactionError, match="sessionmaker"):
            outbox.put(sessionmaker(engine), _event("maker"))  # type: ignore[arg-type]
        with Session(engine) as session:
            with pytest.raises(NotInTransactionError, match=r"session.begin\(\)"):
                outbox.put(session, _event("no.begin"))
        with engine.connect() as conn:
            autocommit = conn.execution_options(isolation_level="AUTOCOMMIT")
            with autocommit.begin(), pytest.raises(NotInTransactionError, match="AUTOCOMMIT"):
                outbox.put(autocommit, _event("sa.autocommit"))
    finally:
        engine.dispose()
    assert _topics(url) == ["explicit.begin"]


async def test_async_refusals_outside_a_transaction(url: str) -> None:
    import aiomysql
    import asyncmy
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    outbox, args = Outbox(storage="mariadb"), connect_args(url)
    aio = await aiomysql.connect(
        host=args["host"],
        port=args["port"],
        user=args["user"],
        db=args["database"],
        autocommit=True,
    )
    my = await asyncmy.connect(**args, autocommit=True)
    try:
        for conn in (aio, my):
            with pytest.raises(NotInTransactionError, match="autocommit mode"):
                await outbox.aput(conn, _event("lonely"))
            await conn.begin()
            await outbox.aput(conn, _event(f"begun.{type(conn).__module__}"))
            await conn.commit()
    finally:
        aio.close()
        my.close()
    with pytest.raises(NotInTransactionError, match="closed"):
        await outbox.aput(aio, _event("closed"))
    engine = create_async_engine(url.replace("mysql://", "mysql+aiomysql://"))
    try:
        with pytest.raises(NotInTransactionError, match="AsyncEngine"):
            await outbox.aput(engine, _event("engine"))  # type: ignore[arg-type]
        async with AsyncSession(engine) as session:
            with pytest.raises(NotInTransactionError, match=r"session.begin\(\)"):
                await outbox.aput(session, _event("no.begin"))
    finally:
        await engine.dispose()
    assert _topics(url) == ["begun.aiomysql.connection", "begun.asyncmy.connection"]


def test_an_outbox_for_the_other_database_is_refused_in_one_line(url: str, db_dsn: str) -> None:
    import psycopg

    conn = _connect(url)
    try:
        with pytest.raises(ConfigurationError, match="no LISTEN/NOTIFY") as refused:
            Outbox(notify=True).put(conn, _event("notify"))  # said by MariaDB's backend
        assert "\n" not in str(refused.value)
        with pytest.raises(ConfigurationError, match="pg_logical_emit_message"):
            Outbox(storage="wal").put(conn, _event("wal"))
        with pytest.raises(TableNotFoundError, match="outboxkit migrate"):
            Outbox("missing", storage="mariadb").put(conn, _event("no.table"))
        conn.commit()
    finally:
        conn.close()
    with psycopg.connect(db_dsn) as pg:
        with pytest.raises(ConfigurationError, match="connection is PostgreSQL's"):
            Outbox(storage="mariadb").put(pg, _event("on.postgres"))
    # MariaDB's own errors (they carry a SQLSTATE too) stay MariaDB's: not "wrong database".
    conn = _connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("START TRANSACTION READ ONLY")
        with pytest.raises(pymysql.err.MySQLError, match="READ ONLY"):
            Outbox(storage="mariadb").put(conn, _event("read.only"))
        conn.rollback()
    finally:
        conn.close()
    assert _topics(url) == []


def test_the_default_outbox_writes_mariadbs_table_without_a_storage_setting(url: str) -> None:
    outbox = Outbox()  # README's Outbox(table="outbox"): no storage=, no notify=
    conn = _connect(url)
    try:
        outbox.put(conn, _event("default.put"))
        outbox.put_many(conn, [_event("default.many")])
        conn.commit()
    finally:
        conn.close()
    assert _topics(url) == ["default.put", "default.many"]
    assert outbox.notify is True  # PostgreSQL's NOTIFY stays on; MariaDB's writes send none


def test_a_written_event_is_claimed_with_its_fields_and_times_in_utc(url: str) -> None:
    occurred = dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    event = _event("orders", key="o-7", headers={"x-a": "1"}, occurred_at=occurred)
    conn = _connect(url)
    try:
        Outbox(storage="mariadb").put(conn, event)
        conn.commit()
    finally:
        conn.close()

    async def claim() -> Any:
        store = MariaDBQueueStore(url, "outbox", OutboundMessage)
        try:
            await store.start()
            return await store.claim(
                limit=10, lease=30, token=uuid.uuid4(), owner="r", max_attempts=5
            )
        finally:
            await store.close()

    got = asyncio.run(claim())
    assert got is not None
    (message,) = got.items
    assert (message.event_id, message.topic, message.key, message.payload, message.headers) == (
        event.event_id,
        "orders",
        "o-7",
        event.payload,
        {"x-a": "1"},
    )
    assert message.occurred_at == occurred


def test_a_cut_connection_is_a_store_outage_and_the_next_claim_reconnects(
    url: str, proxy_factory: Any
) -> None:
    conn = _connect(url)
    try:
        Outbox(storage="mariadb").put(conn, _event("after.outage"))
        conn.commit()
    finally:
        conn.close()
    args = connect_args(url)
    proxy = proxy_factory("127.0.0.1", args["port"])
    via_proxy = url.replace(f":{args['port']}/", f":{proxy.port}/")

    async def run() -> Any:
        store = MariaDBQueueStore(via_proxy, "outbox", OutboundMessage)
        try:
            await store.start()
            proxy.cut()  # every open connection dropped, as a restart or a network fault
            with pytest.raises(StoreUnavailable):
                await store.claim(limit=10, lease=30, token=uuid.uuid4(), owner="r", max_attempts=5)
            proxy.resume()
            return await store.claim(
                limit=10, lease=30, token=uuid.uuid4(), owner="r", max_attempts=5
            )
        finally:
            await store.close()

    got = asyncio.run(run())
    assert got is not None
    assert [m.topic for m in got.items] == ["after.outage"]


async def test_aiomysql_sends_bytes_where_its_own_quoting_fails(url: str) -> None:
    """aiomysql 0.3.2 cannot quote a bytes parameter with PyMySQL >= 1.2.3
    (aio-libs/aiomysql#1080): its own cursor fails where the outbox's write goes through."""
    import aiomysql
    from aiomysql import connection

    args = connect_args(url)
    conn = await aiomysql.connect(
        host=args["host"], port=args["port"], user=args["user"], db=args["database"]
    )
    try:
        broken = not callable(getattr(connection, "escape_bytes_prefixed", None))
        async with conn.cursor() as cur:
            if broken:  # the failure the adapter closes, with the PyMySQL installed here
                with pytest.raises(TypeError, match="not callable"):
                    await cur.execute("SELECT %s", (b"\x00'",))
        payload = b"\x00'\\\"%s\xff"
        await Outbox(storage="mariadb").aput(
            conn, Event(topic="t", event_type="x", payload=payload)
        )
        await conn.commit()
    finally:
        conn.close()
    check = _connect(url, autocommit=True)
    try:
        with check.cursor() as cur:
            cur.execute("SELECT payload FROM outbox")
            assert cur.fetchall() == ((payload,),)
    finally:
        check.close()


async def test_sqlalchemy_defer_writes_with_the_commit_and_not_after_a_rollback(url: str) -> None:
    """defer() queues the event and SQLAlchemy's COMMIT writes it (one INSERT just before).
    asyncmy for adefer: on mysql+aiomysql SQLAlchemy's own cursor quotes the payload, which
    aiomysql 0.3.2 cannot do with PyMySQL >= 1.2.3 (aio-libs/aiomysql#1080)."""
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
    from sqlalchemy.orm import Session

    outbox = Outbox()  # the session's dialect picks MariaDB's table
    engine = sa.create_engine(url.replace("mysql://", "mysql+pymysql://"))
    aengine = create_async_engine(url.replace("mysql://", "mysql+asyncmy://"))
    try:
        with Session(engine) as session, session.begin():
            outbox.defer(session, _event("deferred"))
            assert _topics(url) == []  # queued, written with the COMMIT
        with Session(engine) as session:
            session.begin()
            outbox.defer_many(session, [_event("rolled.back")])
            session.rollback()
        async with AsyncSession(aengine) as asession, asession.begin():
            await outbox.adefer(asession, _event("adeferred"))
    finally:
        engine.dispose()
        await aengine.dispose()
    assert _topics(url) == ["deferred", "adeferred"]
