"""Outbox tables on the private MariaDB for the operator tests: a database of a test's own,
and one set of rows in every state written the same way on MariaDB and PostgreSQL."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pymysql

from outboxkit import Event, Outbox
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from tests.support.mariadb import MariaDB
from tests.support.servers import unique_name


def task_database(request: Any) -> str:
    """A migrated task table for a test parametrized ``["postgresql", "mariadb"]``
    (``request.param``): the ``db_dsn`` fixture's PostgreSQL, or a new database on the
    private mariadbd; its URL."""
    from outboxkit.backends import backend_for

    if request.param == "postgresql":
        url = str(request.getfixturevalue("db_dsn"))
    else:
        url = new_database(request.getfixturevalue("mariadb_server"))
    backend_for(url).migrate(url, "tasks", "outboxkit_tasks")
    return url


def new_database(server: MariaDB, *, inbox: bool = False) -> str:
    """The URL of a new database on ``server`` with the outbox (and the inbox) migrated."""
    name = unique_name("ops")
    root = pymysql.connect(**server.connect_args(), autocommit=True)
    try:
        with root.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
    finally:
        root.close()
    url = server.url_for(name)
    migrate(url)
    if inbox:
        migrate(url, table="processed_events", kind="inbox")
    return url


@contextlib.contextmanager
def own_database(server: MariaDB, prefix: str = "t") -> Iterator[str]:
    """An empty database of the caller's own on ``server`` (its URL), dropped after."""
    name = unique_name(prefix)
    admin = pymysql.connect(**server.connect_args(), autocommit=True)
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        yield server.url_for(name)
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")
    finally:
        admin.close()


def mariadb_execute(url: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run one statement in autocommit; its rows (if any)."""
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(statement, params)
            return list(cur.fetchall())
    finally:
        conn.close()


#: Row ids (1-based, in write order) of each state in :func:`scenario_events`.
DUE = (1, 2, 3)
IN_FLIGHT = (4,)
SCHEDULED = (5,)
FAILED = (6, 7)
PUBLISHED_OLD = (8, 9)
PUBLISHED_NEW = (10,)


def scenario_events(tag: str) -> list[Event]:
    """Ten events: orders (due, in flight, scheduled) and mail (failed, published)."""
    events = [
        Event(topic=f"{tag}.orders", event_type="order.placed", key=f"o{i}", payload={"n": i})
        for i in range(5)
    ]
    events += [
        Event(
            topic=f"{tag}.mail",
            event_type="mail.sent",
            key=f"m{i}",
            payload={"n": i},
            headers={"h": str(i)},
        )
        for i in range(5)
    ]
    return events


def _ids(ids: tuple[int, ...]) -> str:
    return ",".join(str(i) for i in ids)


def _marks(now: str, interval: Any) -> list[str]:
    """The statements that put the rows in their states (``interval(n, unit)`` is SQL)."""
    return [
        f"UPDATE outbox SET created_at = {now} - {interval(10, 'MINUTE')}"
        f" WHERE id IN ({_ids(DUE + IN_FLIGHT)})",
        "UPDATE outbox SET claim_token = '0190a7c4-0000-7000-8000-000000000001',"
        f" available_at = {now} + {interval(1, 'HOUR')}, attempts = 1"
        f" WHERE id IN ({_ids(IN_FLIGHT)})",
        f"UPDATE outbox SET available_at = {now} + {interval(1, 'HOUR')}"
        f" WHERE id IN ({_ids(SCHEDULED)})",
        "UPDATE outbox SET status = 2, attempts = 10, last_error = 'broker said no'"
        f" WHERE id IN ({_ids(FAILED)})",
        f"UPDATE outbox SET status = 1, published_at = {now} - {interval(3, 'DAY')}"
        f" WHERE id IN ({_ids(PUBLISHED_OLD)})",
        f"UPDATE outbox SET status = 1, published_at = {now} WHERE id IN ({_ids(PUBLISHED_NEW)})",
    ]


def commit_events(url: str, events: list[Event]) -> None:
    """``events`` written with PyMySQL in one transaction and committed."""
    conn = pymysql.connect(**connect_args(url))
    try:
        Outbox(storage="mariadb").put_many(conn, events)
        conn.commit()
    finally:
        conn.close()


def fill_mariadb(url: str, events: list[Event]) -> None:
    """``events`` written with PyMySQL and committed, then put in their states."""
    conn = pymysql.connect(**connect_args(url))
    try:
        Outbox(storage="mariadb").put_many(conn, events)
        with conn.cursor() as cur:
            for statement in _marks("UTC_TIMESTAMP(6)", lambda n, unit: f"INTERVAL {n} {unit}"):
                cur.execute(statement)
        conn.commit()
    finally:
        conn.close()


def fill_postgres(dsn: str, events: list[Event]) -> None:
    """The same on PostgreSQL (the reference the MariaDB output is compared with)."""
    with psycopg.connect(dsn) as conn:
        Outbox().put_many(conn, events)
        conn.commit()
        for statement in _marks("now()", lambda n, unit: f"interval '{n} {unit.lower()}'"):
            conn.execute(statement)  # type: ignore[arg-type]


def tag() -> str:
    return uuid.uuid4().hex[:8]
