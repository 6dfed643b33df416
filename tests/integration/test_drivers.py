"""The driver-adapter layer: one resolution per connection type, shared by the write and
the inbox; a new driver is one adapter registered in one place."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from outboxkit import Inbox, NotInTransactionError, Outbox
from outboxkit.backends.postgres.inbox_sql import InboxStatements
from outboxkit.drivers import base as drivers
from outboxkit.drivers import psycopg_adapter
from tests.integration.test_write import _event
from tests.integration.test_write import shop_dsn as shop_dsn  # the fixture, shared
from tests.support.relaying import count, rows


@pytest.fixture
def inbox_dsn(shop_dsn: str) -> str:
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        conn.execute(InboxStatements("processed_events").ddl())
    return shop_dsn


def test_an_adapter_is_resolved_once_per_connection_type(shop_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(shop_dsn) as conn:
        with conn.transaction():
            outbox.put(conn, _event(1))
        adapter = drivers._SYNC_BY_TYPE[psycopg.Connection]
        assert isinstance(adapter, psycopg_adapter.PsycopgSync)
        calls: list[type] = []
        original = drivers._find

        def counting(adapters: Any, conn_type: type) -> Any:
            calls.append(conn_type)
            return original(adapters, conn_type)

        drivers._find = counting  # type: ignore[assignment]
        try:
            with conn.transaction():
                outbox.put(conn, _event(2))
                outbox.put_many(conn, [_event(3), _event(4)])
        finally:
            drivers._find = original
        assert calls == []  # the hot path is one dict lookup, no isinstance chain
    assert count(shop_dsn) == 4


def test_sqlalchemy_over_psycopg_writes_through_the_drivers_cached_cursor(shop_dsn: str) -> None:
    outbox = Outbox()
    engine = sa.create_engine(shop_dsn.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with Session(engine) as session, session.begin():
            outbox.put(session, _event(1))
            raw = session.connection().connection.dbapi_connection
            entry = outbox._sync_cursor.entry
            assert entry is not None and entry[0] is raw
            outbox.put(session, _event(2))
            assert outbox._sync_cursor.entry is entry  # reused, not rebuilt
    finally:
        engine.dispose()
    assert count(shop_dsn) == 2


def test_generic_dbapi_driver_writes_and_records_through_sqlalchemy(inbox_dsn: str) -> None:
    outbox, inbox = Outbox(), Inbox()
    event_id = uuid.uuid4()
    engine = sa.create_engine(inbox_dsn.replace("postgresql://", "postgresql+psycopg2://"))
    try:
        with Session(engine) as session, session.begin():
            outbox.put_many(session, [_event(1), _event(2)])
            assert inbox.mark(session, "billing", event_id) is True
            assert inbox.mark(session, "billing", event_id) is False
            assert inbox.seen(session, "billing", event_id) is True
    finally:
        engine.dispose()
    assert [r["key"] for r in rows(inbox_dsn)] == ["customer-1", "customer-2"]


def test_sessionmakers_are_refused_with_what_to_do(shop_dsn: str) -> None:
    engine = sa.create_engine(shop_dsn.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with pytest.raises(NotInTransactionError, match=r"sessionmaker; open a Session"):
            Outbox().put(sessionmaker(engine), _event())  # type: ignore[arg-type]
        with pytest.raises(NotInTransactionError, match="sessionmaker"):
            Inbox().mark(sessionmaker(engine), "billing", uuid.uuid4())  # type: ignore[arg-type]
    finally:
        engine.dispose()
    assert count(shop_dsn) == 0


async def test_async_engines_and_sessionmakers_are_refused(shop_dsn: str) -> None:
    engine = create_async_engine(shop_dsn.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with pytest.raises(NotInTransactionError, match="AsyncEngine"):
            await Outbox().aput(engine, _event())  # type: ignore[arg-type]
        with pytest.raises(NotInTransactionError, match="async_sessionmaker"):
            await Outbox().aput(async_sessionmaker(engine), _event())  # type: ignore[arg-type]
    finally:
        await engine.dispose()
    assert count(shop_dsn) == 0


async def test_the_write_and_the_inbox_refuse_asyncpg_with_one_message(inbox_dsn: str) -> None:
    conn = await asyncpg.connect(inbox_dsn)
    try:
        with pytest.raises(NotInTransactionError) as write:
            await Outbox().aput(conn, _event())
        with pytest.raises(NotInTransactionError) as inbox:
            await Inbox().amark(conn, "billing", uuid.uuid4())
    finally:
        await conn.close()
    assert str(write.value) == str(inbox.value)
    assert "async with conn.transaction()" in str(write.value)


def test_a_sync_call_with_an_async_connection_names_the_callers_async_methods() -> None:
    class AsyncpgLike:  # an asyncpg connection by module and shape
        __module__ = "asyncpg.connection"

        def is_in_transaction(self) -> bool:
            return True

    with pytest.raises(TypeError, match=r"use `await aput\(\)`/`aput_many\(\)`"):
        Outbox().put(AsyncpgLike(), _event())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"use ahandle\(\)/amark\(\)/aseen\(\)"):
        Inbox().mark(AsyncpgLike(), "billing", uuid.uuid4())  # type: ignore[arg-type]


def test_a_cursor_is_refused_without_pointing_to_the_other_api(shop_dsn: str) -> None:
    with psycopg.connect(shop_dsn) as conn:
        with conn.cursor() as cursor, pytest.raises(TypeError, match="expected psycopg.C") as info:
            Outbox().put(cursor, _event())  # type: ignore[arg-type]
        assert "async" not in str(info.value)
        sync_hint = r"\(this is a sync connection: use put\(\)/put_many\(\)\)"
        with pytest.raises(TypeError, match=sync_hint):
            asyncio.run(Outbox().aput(conn, _event()))  # type: ignore[arg-type]


class AtomicConnection:
    """A connection wrapper of a framework outboxkit does not know (Django's is shaped
    so): a psycopg connection inside, and its own flag for an open atomic block."""

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self.connection = connection
        self.in_atomic_block = False


class AtomicAdapter(drivers.SyncAdapter):
    label = "AtomicConnection"
    modules = (__name__,)

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        return issubclass(conn_type, AtomicConnection)

    def check(self, conn: AtomicConnection) -> None:
        if not conn.in_atomic_block:
            raise NotInTransactionError("AtomicConnection outside an atomic block")

    def _driver(self, conn: AtomicConnection) -> drivers.SyncAdapter:
        self.check(conn)
        driver = drivers.raw_sync_adapter(conn.connection)
        assert driver is not None and driver.joins(conn.connection)
        return driver

    def execute(
        self,
        conn: AtomicConnection,
        stmt: drivers.Statement,
        params: Sequence[Any],
        cursors: drivers.CursorCache | None,
    ) -> None:
        self._driver(conn).run(conn.connection, stmt, params, cursors)

    def fetch_value(
        self, conn: AtomicConnection, stmt: drivers.Statement, params: Sequence[Any]
    ) -> Any:
        return self._driver(conn).run_fetch_value(conn.connection, stmt, params)


def test_a_new_driver_is_one_adapter_registered_for_the_write_and_the_inbox(
    inbox_dsn: str,
) -> None:
    outbox, inbox = Outbox(), Inbox()
    event_id = uuid.uuid4()
    with psycopg.connect(inbox_dsn) as raw:
        wrapped = AtomicConnection(raw)
        with pytest.raises(TypeError, match="psycopg.Connection, SQLAlchemy .*mysqlclient"):
            outbox.put(wrapped, _event(1))  # type: ignore[arg-type]
        drivers.register(AtomicAdapter())
        try:
            with pytest.raises(NotInTransactionError, match="outside an atomic block"):
                outbox.put(wrapped, _event(1))  # type: ignore[arg-type]
            wrapped.in_atomic_block = True
            outbox.put(wrapped, _event(2))  # type: ignore[arg-type]
            assert inbox.mark(wrapped, "billing", event_id) is True  # type: ignore[arg-type]
            raw.commit()
        finally:
            drivers._SYNC.remove(next(a for a in drivers._SYNC if isinstance(a, AtomicAdapter)))
            drivers._SYNC_BY_TYPE.clear()
    assert [r["key"] for r in rows(inbox_dsn)] == ["customer-2"]
    with psycopg.connect(inbox_dsn) as conn:
        assert inbox.seen(conn, "billing", event_id) is True
