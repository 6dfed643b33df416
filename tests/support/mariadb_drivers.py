"""Every MariaDB/MySQL driver outboxkit writes through, as one connection factory each.

A test parametrised over :data:`SYNC` / :data:`ASYNC` proves a guarantee once for every
driver: PyMySQL and mysqlclient, aiomysql and asyncmy, and SQLAlchemy 2 on each of their
dialects (a Connection and a Session, an AsyncConnection and an AsyncSession). A driver
that is not installed skips with a reason (fails under OUTBOXKIT_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

from tests.support.servers import require_or_skip


def driver_module(name: str) -> Any:
    """The driver module ``name``, or a skip naming it (a failure in CI)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require_or_skip(f"{name} is not installed: {exc}")


@dataclass(frozen=True)
class Driver:
    """``transaction(args, url)``: a context that yields what the write takes, inside an
    open transaction, and commits at the end (rolls back on an exception)."""

    name: str
    transaction: Callable[[dict[str, Any], str], Any]

    def __str__(self) -> str:
        return self.name


def _sa_url(url: str, dialect: str) -> str:
    return url.replace("mysql://", f"mysql+{dialect}://", 1)


@contextmanager
def _dbapi(module: str, args: dict[str, Any]) -> Iterator[Any]:
    conn = driver_module(module).connect(**args)
    try:
        yield conn  # autocommit off: the first statement opens the transaction
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    finally:
        conn.close()


@contextmanager
def _sa(dialect: str, url: str, session: bool) -> Iterator[Any]:
    driver_module({"pymysql": "pymysql", "mysqldb": "MySQLdb"}[dialect])
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    engine = sa.create_engine(_sa_url(url, dialect))
    try:
        if session:
            with Session(engine) as s, s.begin():
                yield s
        else:
            with engine.begin() as conn:
                yield conn
    finally:
        engine.dispose()


SYNC = [
    Driver("pymysql", lambda args, url: _dbapi("pymysql", args)),
    Driver("mysqlclient", lambda args, url: _dbapi("MySQLdb", args)),
    Driver("sqlalchemy-pymysql-connection", lambda args, url: _sa("pymysql", url, False)),
    Driver("sqlalchemy-pymysql-session", lambda args, url: _sa("pymysql", url, True)),
    Driver("sqlalchemy-mysqldb-session", lambda args, url: _sa("mysqldb", url, True)),
]


@asynccontextmanager
async def _async_dbapi(module: str, args: dict[str, Any]) -> AsyncIterator[Any]:
    if module == "aiomysql":  # aiomysql names the database `db`
        args = {**{k: v for k, v in args.items() if k != "database"}, "db": args["database"]}
    conn = await driver_module(module).connect(**args)
    try:
        yield conn
        await conn.commit()
    except BaseException:
        await conn.rollback()
        raise
    finally:
        conn.close()


@asynccontextmanager
async def _sa_async(dialect: str, url: str, session: bool) -> AsyncIterator[Any]:
    driver_module(dialect)
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    engine = create_async_engine(_sa_url(url, dialect))
    try:
        if session:
            async with AsyncSession(engine) as s, s.begin():
                yield s
        else:
            async with engine.begin() as conn:
                yield conn
    finally:
        await engine.dispose()


ASYNC = [
    Driver("aiomysql", lambda args, url: _async_dbapi("aiomysql", args)),
    Driver("asyncmy", lambda args, url: _async_dbapi("asyncmy", args)),
    Driver("sqlalchemy-aiomysql-session", lambda args, url: _sa_async("aiomysql", url, True)),
    Driver("sqlalchemy-asyncmy-connection", lambda args, url: _sa_async("asyncmy", url, False)),
]


@contextmanager
def database(server: Any, prefix: str, *migrations: Callable[[str], Any]) -> Iterator[str]:
    """The URL of a new database on ``server``, with ``migrations`` applied; dropped after."""
    import pymysql

    from tests.support.servers import unique_name

    name = unique_name(prefix)
    admin = pymysql.connect(**server.connect_args(), autocommit=True)
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        for migrate in migrations:
            migrate(server.url_for(name))
        yield server.url_for(name)
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")
    finally:
        admin.close()


def outbox_topics(url: str, table: str = "outbox") -> list[str]:
    """The topics of ``table``'s rows on the database of ``url``, in id order."""
    import pymysql

    from outboxkit.backends.mariadb.sql import connect_args

    conn = pymysql.connect(**connect_args(url), autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT topic FROM {table} ORDER BY id")
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()
