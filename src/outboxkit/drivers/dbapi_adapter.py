"""A DB-API 2 driver connection (psycopg2, PyMySQL, mysqlclient; aiomysql, asyncmy async).

These drivers share one shape: the connection's class names the driver (matched along
its MRO, so the optional driver is never imported), a statement runs through a cursor
with the parameters as the DB-API takes them, and only "is a transaction open?" differs:
each driver's adapter supplies ``check``.

A statement that returns no rows answers ``fetch_value`` with whether it wrote one (the
affected-row count): MariaDB's inbox record is an ``INSERT IGNORE``, which has no
``RETURNING`` on MySQL 8.

``commit_with`` is ``Outbox.transaction()``'s end on MariaDB/MySQL: the events' INSERT and
the COMMIT as one multi-statement query, one round trip, where the connection was opened
with ``CLIENT.MULTI_STATEMENTS`` (mysqlclient, aiomysql and asyncmy always ask for it;
PyMySQL only when told); without it, the INSERT and then the COMMIT. Every result is read:
an error in any raises, and after one the server runs none of the statements after it, so
a failed INSERT never reaches the COMMIT. It answers the first value of each result set
(``Tasks.transaction()``'s ``INSERT … RETURNING id`` each give one: the new task's id, or
none for a skipped duplicate), as ``run_all`` does for the statements sent before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from outboxkit.drivers.base import AsyncAdapter, CursorCache, Statement, SyncAdapter, dbapi_params

_COMMIT = ";\nCOMMIT"


def _first_values(cur: Any) -> list[Any]:
    """The first value of each of the cursor's result sets left (None for an empty one),
    reading them all: an error in any statement raises here."""
    values: list[Any] = []
    while True:
        if cur.description is not None:
            rows = cur.fetchall()
            values.append(rows[0][0] if rows else None)
        if not cur.nextset():
            return values


async def _afirst_values(cur: Any) -> list[Any]:
    """:func:`_first_values` for an async cursor."""
    values: list[Any] = []
    while True:
        if cur.description is not None:
            rows = await cur.fetchall()
            values.append(rows[0][0] if rows else None)
        if not await cur.nextset():
            return values


def _is_connection_class(conn_type: type, module: str, name: str) -> bool:
    return any(c.__module__ == module and c.__name__ == name for c in conn_type.__mro__)


class DBAPISync(SyncAdapter):
    """A sync DB-API driver: ``check`` is the driver's; the rest runs through a cursor."""

    #: (module, class name) of the driver's connection class.
    connection_class: ClassVar[tuple[str, str]]
    #: Whether, under SQLAlchemy (which has checked the transaction), the statement goes
    #: straight to this driver's connection rather than through ``exec_driver_sql``.
    joins_sqlalchemy: ClassVar[bool] = False

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        return _is_connection_class(conn_type, *cls.connection_class)

    def joins(self, conn: Any) -> bool:
        return self.joins_sqlalchemy

    def execute(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        self.check(conn)
        self.run(conn, stmt, params, cursors)

    def fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        self.check(conn)
        return self.run_fetch_value(conn, stmt, params)

    def run(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        with conn.cursor() as cur:
            cur.execute(stmt.text, dbapi_params(params))

    def run_fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        with conn.cursor() as cur:
            cur.execute(stmt.text, dbapi_params(params))
            if cur.description is None:
                return bool(cur.rowcount > 0)
            row = cur.fetchone()
        return row[0] if row else None

    # -- Outbox.transaction() (MariaDB/MySQL drivers) --------------------------------------

    def needs_begin(self, conn: Any) -> bool:
        """Autocommit with no transaction open (``transaction()`` then BEGINs); refuses a
        closed connection."""
        raise NotImplementedError

    def multi_statements(self, conn: Any) -> bool:
        """Whether the connection takes several statements in one query."""
        return True

    def run_all(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> list[Any]:
        """Run ``stmt`` (several statements, where the connection takes them): the first
        value of each result set."""
        with conn.cursor() as cur:
            cur.execute(stmt.text, dbapi_params(params))
            return _first_values(cur)

    def commit_with(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> list[Any]:
        """Run ``stmt`` then COMMIT, in one round trip where the connection allows it; the
        first value of each of ``stmt``'s result sets."""
        values = dbapi_params(params)
        with conn.cursor() as cur:
            if not self.multi_statements(conn):
                cur.execute(stmt.text, values)
                found = _first_values(cur)
                conn.commit()
                return found
            cur.execute(stmt.text + _COMMIT, values)
            return _first_values(cur)  # (the COMMIT's error, if any, is raised here)


class DBAPIAsync(AsyncAdapter):
    """:class:`DBAPISync` for async DB-API-shaped drivers (``async with conn.cursor()``)."""

    connection_class: ClassVar[tuple[str, str]]

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        return _is_connection_class(conn_type, *cls.connection_class)

    def joins(self, conn: Any) -> bool:
        # MySQL's transactions begin implicitly (autocommit off, which SQLAlchemy's adapter
        # has checked): the driver connection's transaction is the session's.
        return True

    async def execute(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        self.check(conn)
        await self.run(conn, stmt, params, cursors)

    async def fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        self.check(conn)
        return await self.run_fetch_value(conn, stmt, params)

    def query(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> tuple[str, Any]:
        """What ``cursor.execute`` is given: the text and the DB-API parameters."""
        return stmt.text, dbapi_params(params)

    def cursor(self, conn: Any) -> Any:
        """The cursor outboxkit's statements run on (the connection's own by default)."""
        return conn.cursor()

    async def run(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        async with self.cursor(conn) as cur:
            await cur.execute(*self.query(conn, stmt, params))

    async def run_fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        async with self.cursor(conn) as cur:
            await cur.execute(*self.query(conn, stmt, params))
            if cur.description is None:
                return bool(cur.rowcount > 0)
            row = await cur.fetchone()
        return row[0] if row else None

    # -- Outbox.atransaction() ---------------------------------------------------------------

    def needs_begin(self, conn: Any) -> bool:
        raise NotImplementedError

    async def run_all(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> list[Any]:
        """:meth:`DBAPISync.run_all`."""
        async with self.cursor(conn) as cur:
            await cur.execute(*self.query(conn, stmt, params))
            return await _afirst_values(cur)

    async def commit_with(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> list[Any]:
        """:meth:`DBAPISync.commit_with`: aiomysql and asyncmy always take several statements."""
        text = stmt.text + _COMMIT
        async with self.cursor(conn) as cur:
            await cur.execute(*self.query(conn, Statement(text, text), params))
            return await _afirst_values(cur)
