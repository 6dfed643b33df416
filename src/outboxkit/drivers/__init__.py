"""Database driver glue: what outboxkit needs from each driver, behind one small surface.

``base`` defines the adapter interface and the registry; ``dbapi_adapter`` the shape every
DB-API driver shares; each driver is one module
(``psycopg_adapter``, ``asyncpg_adapter``, ``sqlalchemy_adapter``, ``psycopg2_adapter``;
MariaDB/MySQL: ``pymysql_adapter``, ``mysqlclient_adapter``, ``aiomysql_adapter``,
``asyncmy_adapter``) registered below.
Adding a driver is one new module and one line here (and its type in the unions).
``psycopg_private`` is the only place that reads psycopg's private state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

import psycopg

from outboxkit.drivers.aiomysql_adapter import AiomysqlAsync
from outboxkit.drivers.asyncmy_adapter import AsyncmyAsync
from outboxkit.drivers.asyncpg_adapter import Asyncpg
from outboxkit.drivers.base import (
    AsyncAdapter,
    CursorCache,
    Statement,
    SyncAdapter,
    Use,
    async_adapter,
    register,
    sync_adapter,
    type_name,
)
from outboxkit.drivers.mysqlclient_adapter import MySQLdbSync
from outboxkit.drivers.psycopg2_adapter import Psycopg2Sync
from outboxkit.drivers.psycopg_adapter import PsycopgAsync, PsycopgSync
from outboxkit.drivers.pymysql_adapter import PyMySQLSync
from outboxkit.drivers.sqlalchemy_adapter import SQLAlchemyAsync, SQLAlchemySync

if TYPE_CHECKING:
    import asyncpg
    import asyncpg.pool
    import sqlalchemy.engine
    import sqlalchemy.ext.asyncio
    import sqlalchemy.orm

    #: What the sync API (``put``, ``Inbox.mark``) takes: a connection inside a
    #: transaction. Pools, engines and sessionmakers are not in it, so a type
    #: checker rejects them before anything runs (the adapters refuse them at run time).
    SyncConnection: TypeAlias = (
        psycopg.Connection[Any] | sqlalchemy.orm.Session | sqlalchemy.engine.Connection
    )
    #: What the async API (``aput``, ``Inbox.amark``) takes.
    AsyncConnection: TypeAlias = (
        psycopg.AsyncConnection[Any]
        | asyncpg.Connection[Any]
        | asyncpg.pool.PoolConnectionProxy[Any]
        | sqlalchemy.ext.asyncio.AsyncSession
        | sqlalchemy.ext.asyncio.AsyncConnection
    )
else:
    SyncConnection = Any
    AsyncConnection = Any

for _adapter in (PsycopgSync(), PsycopgAsync(), Asyncpg(), SQLAlchemySync(), SQLAlchemyAsync()):
    register(_adapter)
register(Psycopg2Sync())
for _mysql in (PyMySQLSync(), MySQLdbSync(), AiomysqlAsync(), AsyncmyAsync()):
    register(_mysql)

__all__ = [
    "AsyncAdapter",
    "AsyncConnection",
    "CursorCache",
    "Statement",
    "SyncAdapter",
    "SyncConnection",
    "Use",
    "async_adapter",
    "register",
    "sync_adapter",
    "type_name",
]
