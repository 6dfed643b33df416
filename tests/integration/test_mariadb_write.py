"""`Outbox(storage="mariadb")` with PyMySQL: events commit and roll back with the caller's
transaction on the private MariaDB, and a write outside a transaction is refused."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from outboxkit import Event, Outbox
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.queue import MariaDBQueueStore
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import NotInTransactionError, StoreUnavailable
from outboxkit.publishers.base import OutboundMessage
from tests.support.mariadb import MariaDB
from tests.support.servers import unique_name


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    name = unique_name("w")
    admin = pymysql.connect(**mariadb_server.connect_args(), autocommit=True)
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        migrate(mariadb_server.url_for(name))
        yield mariadb_server.url_for(name)
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")
    finally:
        admin.close()


def _connect(url: str, **options: Any) -> Any:
    return pymysql.connect(**connect_args(url), **options)


def _topics(url: str) -> list[str]:
    conn = _connect(url, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT topic FROM outbox ORDER BY id")
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


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
    assert Outbox(storage="mariadb").notify is False


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
