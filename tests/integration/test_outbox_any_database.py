"""One ``Outbox()`` (no ``storage=``) writing PostgreSQL's and MariaDB's outbox tables in one
process, each through the storage of the connection's database: put, put_many,
transaction(), defer and their async forms, interleaved on the same object."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pymysql
import pytest

from outboxkit import Event, Outbox
from outboxkit.backends import backend_of
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import ConfigurationError
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database, driver_module, outbox_topics


@pytest.fixture
def my_url(mariadb_server: MariaDB) -> Iterator[str]:
    with database(mariadb_server, "any", migrate) as url:
        yield url


def _event(topic: str, key: str | None = None) -> Event:
    return Event(topic=topic, event_type="order.placed", payload={"id": 7}, key=key)


def _pg_topics(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT topic FROM outbox ORDER BY id")]


def test_one_outbox_writes_both_databases_through_each_connections_storage(
    db_dsn: str, my_url: str
) -> None:
    outbox = Outbox(table="outbox")
    my = pymysql.connect(**connect_args(my_url))
    try:
        with psycopg.connect(db_dsn) as pg:
            for round_ in range(2):  # interleaved: each database's storage is kept, not swapped
                with pg.transaction():
                    outbox.put(pg, _event(f"pg.put.{round_}"))
                    outbox.put_many(pg, [_event(f"pg.many.{round_}", key="k")])
                outbox.put(my, _event(f"my.put.{round_}"))
                outbox.put_many(my, [_event(f"my.many.{round_}", key="k")])
                my.commit()
            with outbox.transaction(pg) as tx:
                tx.put(_event("pg.tx"))
            with outbox.transaction(my) as mtx:
                mtx.put(_event("my.tx"))
            outbox.put(my, _event("my.rolled.back"))
            my.rollback()
    finally:
        my.close()
    assert _pg_topics(db_dsn) == [
        "pg.put.0", "pg.many.0", "pg.put.1", "pg.many.1", "pg.tx",
    ]  # fmt: skip
    assert outbox_topics(my_url) == [
        "my.put.0", "my.many.0", "my.put.1", "my.many.1", "my.tx",
    ]  # fmt: skip
    assert {b.name for b in outbox._writers} == {"postgresql", "mariadb"}


async def test_one_outbox_writes_both_databases_from_async_drivers(
    db_dsn: str, my_url: str
) -> None:
    asyncmy = driver_module("asyncmy")
    outbox = Outbox()
    my = await asyncmy.connect(**connect_args(my_url))
    try:
        async with await psycopg.AsyncConnection.connect(db_dsn) as pg:
            async with pg.transaction():
                await outbox.aput(pg, _event("pg.aput"))
                await outbox.aput_many(pg, [_event("pg.aput_many")])
            await my.begin()
            await outbox.aput(my, _event("my.aput"))
            await outbox.aput_many(my, [_event("my.aput_many")])
            await my.commit()
            async with outbox.atransaction(pg) as tx:
                tx.put(_event("pg.atx"))
            async with outbox.atransaction(my) as mtx:
                mtx.put(_event("my.atx"))
    finally:
        my.close()
    assert _pg_topics(db_dsn) == ["pg.aput", "pg.aput_many", "pg.atx"]
    assert outbox_topics(my_url) == ["my.aput", "my.aput_many", "my.atx"]


def test_sqlalchemy_defer_follows_each_engines_dialect(db_dsn: str, my_url: str) -> None:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    outbox = Outbox()
    pg_engine = sa.create_engine(db_dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    my_engine = sa.create_engine(my_url.replace("mysql://", "mysql+pymysql://", 1))
    try:
        for engine, topic in ((pg_engine, "pg.defer"), (my_engine, "my.defer")):
            with Session(engine) as session, session.begin():
                outbox.defer(session, _event(topic))
            with engine.begin() as conn:
                outbox.put(conn, _event(f"{topic}.put"))
    finally:
        pg_engine.dispose()
        my_engine.dispose()
    assert _pg_topics(db_dsn) == ["pg.defer", "pg.defer.put"]
    assert outbox_topics(my_url) == ["my.defer", "my.defer.put"]


def test_what_one_database_cannot_do_is_said_by_its_backend_and_the_other_still_works(
    db_dsn: str, my_url: str
) -> None:
    outbox = Outbox(notify=True)
    my = pymysql.connect(**connect_args(my_url))
    try:
        assert backend_of(my).can("notify") is False
        with pytest.raises(ConfigurationError, match="no LISTEN/NOTIFY"):
            outbox.put(my, _event("my.notify"))
        my.rollback()
    finally:
        my.close()
    with psycopg.connect(db_dsn) as pg, pg.transaction():
        outbox.put(pg, _event(f"pg.{uuid.uuid4().hex[:6]}"))
    assert len(_pg_topics(db_dsn)) == 1
    assert outbox_topics(my_url) == []
