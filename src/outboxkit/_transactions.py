"""Is this connection inside an open transaction? One answer per driver, shared by the
outbox write and the inbox: both must refuse to run where they could not commit
atomically with the caller's change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from outboxkit.drivers import psycopg_private as private
from outboxkit.errors import NotInTransactionError


def type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_psycopg_usable(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
) -> TransactionStatus:
    """Refuse a closed connection or a failed transaction; return the transaction status."""
    if conn.closed:
        raise NotInTransactionError("the psycopg connection is closed")
    status = conn.pgconn.transaction_status  # conn.info builds a new object per access
    if status == TransactionStatus.INERROR:
        raise NotInTransactionError(
            "the transaction has already failed (an earlier statement raised);"
            " roll back and retry the whole unit of work"
        )
    return TransactionStatus(status)


def check_psycopg(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    status = check_psycopg_usable(conn)
    # Pipeline mode: statements are queued and libpq cannot tell whether a BEGIN is
    # among them without a round trip. psycopg counts its open transaction() blocks;
    # a non-autocommit connection has begun one implicitly.
    if status == TransactionStatus.ACTIVE and (
        not conn.autocommit or private.open_transaction_blocks(conn) > 0
    ):
        return
    if conn.autocommit and status != TransactionStatus.INTRANS:
        raise NotInTransactionError(
            "the psycopg connection is in autocommit mode with no transaction open;"
            " write inside `with conn.transaction():` so the event commits with your change"
        )


def check_asyncpg(conn: Any) -> None:
    if conn.is_closed() or not conn.is_in_transaction():
        raise NotInTransactionError(
            "asyncpg connection has no open transaction; write inside"
            " `async with conn.transaction():` so the event commits with your change"
        )


def check_dbapi_autocommit(dbapi_conn: Any, original: Any) -> None:
    if getattr(dbapi_conn, "autocommit", False):
        raise NotInTransactionError(
            f"{type_name(original)} runs with isolation_level='AUTOCOMMIT';"
            " each statement would commit on its own, so the event could not be atomic"
            " with your change"
        )


def for_paramstyle(paramstyle: str, stmt: str, stmt_dollar: str) -> str:
    if paramstyle in ("format", "pyformat"):
        return stmt
    if paramstyle == "numeric_dollar":
        return stmt_dollar
    raise NotImplementedError(f"unsupported DB-API paramstyle {paramstyle!r}")


def stringify_ids(params: Sequence[Any]) -> tuple[Any, ...]:
    # Generic DB-API drivers (psycopg2) do not all adapt uuid.UUID; text casts fine.
    first = params[0]
    ids = [str(u) for u in first] if isinstance(first, list) else str(first)
    return (ids, *params[1:])


def is_asyncpg_connection(conn: Any) -> bool:
    module = type(conn).__module__
    if not module.startswith("asyncpg"):
        return False
    if hasattr(conn, "acquire") and not hasattr(conn, "is_in_transaction"):
        raise NotInTransactionError(
            "got an asyncpg pool; acquire a connection and write inside"
            " `async with conn.transaction():`"
        )
    return hasattr(conn, "is_in_transaction")


def sqlalchemy_sync_connection(conn: Any) -> Any:
    """The SQLAlchemy ``Connection`` behind a Session/Connection, checked; else None."""
    module = type(conn).__module__
    if not module.startswith("sqlalchemy"):
        return None
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.orm import Session

    if isinstance(conn, Session):
        if not conn.in_transaction():
            raise NotInTransactionError(
                "the SQLAlchemy Session has no transaction begun; write inside"
                " `with session.begin():` so the event commits with your change"
            )
        return conn.connection()
    if isinstance(conn, Connection):
        if conn.closed or not conn.in_transaction():
            raise NotInTransactionError(
                "the SQLAlchemy Connection has no transaction begun; write inside"
                " `with conn.begin():` (or engine.begin()) so the event commits with your change"
            )
        return conn
    if isinstance(conn, Engine):
        raise NotInTransactionError(
            "got a SQLAlchemy Engine; pass the Connection or Session of your transaction"
        )
    return None


async def sqlalchemy_async_connection(conn: Any) -> Any:
    module = type(conn).__module__
    if not module.startswith("sqlalchemy"):
        return None
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    if isinstance(conn, AsyncSession):
        if not conn.in_transaction():
            raise NotInTransactionError(
                "the SQLAlchemy AsyncSession has no transaction begun; write inside"
                " `async with session.begin():` so the event commits with your change"
            )
        return await conn.connection()
    if isinstance(conn, AsyncConnection):
        if conn.closed or not conn.in_transaction():
            raise NotInTransactionError(
                "the SQLAlchemy AsyncConnection has no transaction begun; write inside"
                " `async with conn.begin():` so the event commits with your change"
            )
        return conn
    if isinstance(conn, AsyncEngine):
        raise NotInTransactionError(
            "got a SQLAlchemy AsyncEngine; pass the AsyncConnection or AsyncSession"
            " of your transaction"
        )
    return None
