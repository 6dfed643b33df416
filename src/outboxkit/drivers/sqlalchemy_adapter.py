"""SQLAlchemy ``Session``/``Connection`` and their async twins, over any DB-API driver.

SQLAlchemy owns the transaction: these adapters check it, then hand the statement
straight to the driver connection underneath when outboxkit has an adapter for it
(psycopg, asyncpg and the MariaDB/MySQL drivers: ``exec_driver_sql``'s machinery costs
more client CPU than the INSERT), else run it through ``exec_driver_sql`` in the dialect's
parameter style (psycopg2 and other DB-API drivers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outboxkit.drivers.base import (
    AsyncAdapter,
    CursorCache,
    Statement,
    SyncAdapter,
    dbapi_autocommit,
    dbapi_params,
    for_paramstyle,
    raw_async_adapter,
    raw_sync_adapter,
)
from outboxkit.errors import NotInTransactionError


def _value(result: Any) -> Any:
    """The first value of the first row (None without one); for a statement without rows
    (MariaDB's ``INSERT IGNORE``), whether it wrote one (as ``dbapi_adapter``'s)."""
    if not result.returns_rows:
        return bool(result.rowcount > 0)
    first = result.first()
    return first[0] if first else None


def _is_sqlalchemy(conn_type: type) -> bool:
    return conn_type.__module__.startswith("sqlalchemy")


class SQLAlchemySync(SyncAdapter):
    label = "SQLAlchemy Session/Connection"
    modules = ("sqlalchemy.orm", "sqlalchemy.engine")

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        if not _is_sqlalchemy(conn_type):
            return False
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session

        return issubclass(conn_type, Session | Connection)

    @classmethod
    def refusal(cls, conn_type: type) -> str | None:
        if not _is_sqlalchemy(conn_type):
            return None
        from sqlalchemy.engine import Engine
        from sqlalchemy.orm import sessionmaker

        if issubclass(conn_type, Engine):
            return "got a SQLAlchemy Engine; pass the Connection or Session of your transaction"
        if issubclass(conn_type, sessionmaker):
            return (
                "got a SQLAlchemy sessionmaker; open a Session and pass it inside"
                " `with session.begin():`"
            )
        return None

    def check(self, conn: Any) -> None:
        self._connection(conn)

    def transaction_connection(self, conn: Any) -> Any:
        """The SQLAlchemy ``Connection`` of ``conn``'s open transaction (the deferred write
        queues its events on it); refuses as a write would."""
        return self._connection(conn)

    def _connection(self, conn: Any) -> Any:
        """The SQLAlchemy ``Connection`` of the caller's transaction, checked."""
        from sqlalchemy.orm import Session

        if isinstance(conn, Session):
            if not conn.in_transaction():
                raise NotInTransactionError(
                    "the SQLAlchemy Session has no transaction begun; write inside"
                    " `with session.begin():` so the event commits with your change"
                )
            sa = conn.connection()
        else:
            if conn.closed or not conn.in_transaction():
                raise NotInTransactionError(
                    "the SQLAlchemy Connection has no transaction begun; write inside"
                    " `with conn.begin():` (or engine.begin()) so the event commits with"
                    " your change"
                )
            sa = conn
        dbapi_autocommit(sa.connection.dbapi_connection, conn)
        return sa

    def execute(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        sa = self._connection(conn)
        raw = sa.connection.dbapi_connection
        driver = raw_sync_adapter(raw)
        if driver is not None and driver.joins(raw):
            driver.run(raw, stmt, params, cursors)
            return
        sa.exec_driver_sql(for_paramstyle(sa.dialect.paramstyle, stmt), dbapi_params(params))

    def fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        sa = self._connection(conn)
        raw = sa.connection.dbapi_connection
        driver = raw_sync_adapter(raw)
        if driver is not None and driver.joins(raw):
            return driver.run_fetch_value(raw, stmt, params)
        sql = for_paramstyle(sa.dialect.paramstyle, stmt)
        return _value(sa.exec_driver_sql(sql, dbapi_params(params)))


class SQLAlchemyAsync(AsyncAdapter):
    label = "SQLAlchemy AsyncSession/AsyncConnection"
    modules = ("sqlalchemy.ext.asyncio",)

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        if not _is_sqlalchemy(conn_type):
            return False
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

        return issubclass(conn_type, AsyncSession | AsyncConnection)

    @classmethod
    def refusal(cls, conn_type: type) -> str | None:
        if not _is_sqlalchemy(conn_type):
            return None
        from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

        if issubclass(conn_type, AsyncEngine):
            return (
                "got a SQLAlchemy AsyncEngine; pass the AsyncConnection or AsyncSession"
                " of your transaction"
            )
        if issubclass(conn_type, async_sessionmaker):
            return (
                "got a SQLAlchemy async_sessionmaker; open an AsyncSession and pass it inside"
                " `async with session.begin():`"
            )
        return None

    def check(self, conn: Any) -> None:
        self._check(conn)

    def _check(self, conn: Any) -> None:
        from sqlalchemy.ext.asyncio import AsyncSession

        if isinstance(conn, AsyncSession):
            if not conn.in_transaction():
                raise NotInTransactionError(
                    "the SQLAlchemy AsyncSession has no transaction begun; write inside"
                    " `async with session.begin():` so the event commits with your change"
                )
        elif conn.closed or not conn.in_transaction():
            raise NotInTransactionError(
                "the SQLAlchemy AsyncConnection has no transaction begun; write inside"
                " `async with conn.begin():` so the event commits with your change"
            )

    async def transaction_connection(self, conn: Any) -> Any:
        """The sync ``Connection`` under ``conn``'s open transaction (see SQLAlchemySync's)."""
        return (await self._connection(conn))[1]

    async def _connection(self, conn: Any) -> tuple[Any, Any, Any]:
        """The checked AsyncConnection, its sync Connection and the driver connection."""
        from sqlalchemy.ext.asyncio import AsyncSession

        self._check(conn)
        sa = await conn.connection() if isinstance(conn, AsyncSession) else conn
        sync_conn = sa.sync_connection
        assert sync_conn is not None
        dbapi_autocommit(sync_conn.connection.dbapi_connection, conn)
        return sa, sync_conn, sync_conn.connection.driver_connection

    async def execute(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        sa, sync_conn, raw = await self._connection(conn)
        driver = raw_async_adapter(raw)
        if driver is not None and driver.joins(raw):
            await driver.run(raw, stmt, params, cursors)
            return
        sql = for_paramstyle(sync_conn.dialect.paramstyle, stmt)
        await sa.exec_driver_sql(sql, dbapi_params(params))

    async def fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        sa, sync_conn, raw = await self._connection(conn)
        driver = raw_async_adapter(raw)
        if driver is not None and driver.joins(raw):
            return await driver.run_fetch_value(raw, stmt, params)
        sql = for_paramstyle(sync_conn.dialect.paramstyle, stmt)
        return _value(await sa.exec_driver_sql(sql, dbapi_params(params)))
