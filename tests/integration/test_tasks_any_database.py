"""One ``Tasks()`` enqueueing into PostgreSQL's and MariaDB's task tables in one process, each
through the enqueue of the connection's database: ``enqueue``, ``transaction()`` and their
async forms, interleaved on the same object (issue 40 §1, as test_outbox_any_database.py
for ``Outbox()``); the naive object that keeps the first database's statements fails on
the other's connection."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pymysql
import pytest

from outboxkit.backends import backend_for
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.drivers import sync_adapter
from outboxkit.tasks import Tasks
from outboxkit.tasks.registry import _ENQUEUE
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import driver_module
from tests.support.mariadb_ops import mariadb_execute, new_database

TABLE = "outboxkit_tasks"


@pytest.fixture
def pg_url(db_dsn: str) -> str:
    backend_for(db_dsn).migrate(db_dsn, "tasks", TABLE)
    return db_dsn


@pytest.fixture
def my_url(mariadb_server: MariaDB) -> Iterator[str]:
    url = new_database(mariadb_server)
    backend_for(url).migrate(url, "tasks", TABLE)
    yield url


def _make_tasks() -> Tasks:
    tasks = Tasks()

    @tasks.handler("mail")
    def mail(payload: dict[str, Any]) -> None:
        """Never run here: the tests read the tables."""

    return tasks


def _pg_rows(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(f"SELECT id, payload->>'n' FROM {TABLE} ORDER BY id").fetchall()
    return [(int(i), str(n)) for i, n in rows]


def _my_rows(url: str) -> list[tuple[int, str]]:
    rows = mariadb_execute(url, f"SELECT id, JSON_VALUE(payload, '$.n') FROM {TABLE} ORDER BY id")
    return [(int(i), str(n)) for i, n in rows]


def test_one_tasks_enqueues_into_both_databases_through_each_connections_enqueue(
    pg_url: str, my_url: str
) -> None:
    tasks = _make_tasks()
    pg_ids: list[int | None] = []
    my_ids: list[int | None] = []
    my = pymysql.connect(**connect_args(my_url))
    try:
        with psycopg.connect(pg_url) as pg:
            for round_ in range(2):  # interleaved: each database's enqueue is kept, not swapped
                with pg.transaction():
                    pg_ids.append(tasks.enqueue(pg, "mail", {"n": f"pg.{round_}"}))
                my_ids.append(tasks.enqueue(my, "mail", {"n": f"my.{round_}"}))
                my.commit()
            with tasks.transaction(pg) as tx:
                pg_tx = tx.enqueue("mail", {"n": "pg.tx"})
            with tasks.transaction(my) as mtx:
                my_tx = mtx.enqueue("mail", {"n": "my.tx"})
            tasks.enqueue(my, "mail", {"n": "my.rolled.back"})
            my.rollback()
            with pytest.raises(RuntimeError), pg.transaction():
                tasks.enqueue(pg, "mail", {"n": "pg.rolled.back"})
                raise RuntimeError("the order failed")
    finally:
        my.close()
    assert _pg_rows(pg_url) == [(pg_ids[0], "pg.0"), (pg_ids[1], "pg.1"), (pg_tx.id, "pg.tx")]
    assert _my_rows(my_url) == [(my_ids[0], "my.0"), (my_ids[1], "my.1"), (my_tx.id, "my.tx")]
    assert {b.name for b in tasks._enqueuers} == {"postgresql", "mariadb"}


def test_the_naive_tasks_keeping_its_first_databases_enqueue_fails_on_the_other(
    pg_url: str, my_url: str
) -> None:
    tasks = _make_tasks()
    with psycopg.connect(pg_url) as pg, pg.transaction():
        tasks.enqueue(pg, "mail", {"n": "pg.first"})
    # Naive: one enqueue for the object, PostgreSQL's, as its first connection chose it.
    (naive,) = tasks._enqueuers.values()
    params = tasks._params("mail", {"n": "my.naive"}, None, None, None, 0, "default", None, None)
    my = pymysql.connect(**connect_args(my_url))
    try:
        with pytest.raises(pymysql.err.ProgrammingError):  # PostgreSQL's SQL on MariaDB
            naive.enqueue(sync_adapter(my, _ENQUEUE), my, params)
        my.rollback()
        tasks.enqueue(my, "mail", {"n": "my.ours"})  # the object picks MariaDB's per connection
        my.commit()
    finally:
        my.close()
    assert [n for _id, n in _my_rows(my_url)] == ["my.ours"]
    assert [n for _id, n in _pg_rows(pg_url)] == ["pg.first"]


async def test_one_tasks_enqueues_into_both_databases_from_async_drivers(
    pg_url: str, my_url: str
) -> None:
    asyncmy = driver_module("asyncmy")
    tasks = _make_tasks()
    my = await asyncmy.connect(**connect_args(my_url))
    try:
        async with await psycopg.AsyncConnection.connect(pg_url) as pg:
            async with pg.transaction():
                pg_id = await tasks.aenqueue(pg, "mail", {"n": "pg.aenqueue"})
            await my.begin()
            my_id = await tasks.aenqueue(my, "mail", {"n": "my.aenqueue"})
            await my.commit()
            async with tasks.atransaction(pg) as tx:
                pg_tx = tx.enqueue("mail", {"n": "pg.atx"})
            async with tasks.atransaction(my) as mtx:
                my_tx = mtx.enqueue("mail", {"n": "my.atx"})
    finally:
        my.close()
    assert _pg_rows(pg_url) == [(pg_id, "pg.aenqueue"), (pg_tx.id, "pg.atx")]
    assert _my_rows(my_url) == [(my_id, "my.aenqueue"), (my_tx.id, "my.atx")]


def test_sqlalchemy_enqueue_follows_each_engines_dialect(pg_url: str, my_url: str) -> None:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    tasks = _make_tasks()
    pg_engine = sa.create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://", 1))
    my_engine = sa.create_engine(my_url.replace("mysql://", "mysql+pymysql://", 1))
    try:
        for engine, n in ((pg_engine, "pg"), (my_engine, "my")):
            with Session(engine) as session, session.begin():
                tasks.enqueue(session, "mail", {"n": f"{n}.session"})
            with engine.begin() as conn:
                tasks.enqueue(conn, "mail", {"n": f"{n}.connection"})
    finally:
        pg_engine.dispose()
        my_engine.dispose()
    assert [n for _id, n in _pg_rows(pg_url)] == ["pg.session", "pg.connection"]
    assert [n for _id, n in _my_rows(my_url)] == ["my.session", "my.connection"]
