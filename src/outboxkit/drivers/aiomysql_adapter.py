"""aiomysql ``Connection`` (MariaDB/MySQL, async): PyMySQL's protocol state under asyncio.

Refused as PyMySQL is: closed, or autocommit with no transaction open
(``await conn.begin()`` opens one).

aiomysql 0.3.2 cannot send a ``bytes`` parameter with PyMySQL 1.2.3 and later (its
``escape()`` calls ``pymysql.converters.escape_bytes_prefixed``, which PyMySQL turned into
a placeholder string: aio-libs/aiomysql#1080, fix unreleased). Where that is so, this
adapter quotes the parameters itself, as PyMySQL does (bytes as ``_binary X'…'``, the rest
through the connection's ``escape``), and sends the statement without parameters.

Its statements run on a cursor that does not turn the server's notes into Python warnings:
aiomysql's own asks ``SHOW WARNINGS`` after any statement that left one (a round trip) and
``warnings.warn``s each, so the inbox's ``INSERT IGNORE`` of a repeated delivery (its normal
path) raised ``Warning: Duplicate entry`` in the caller's code, an error where warnings are
errors (pytest's ``filterwarnings = error``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outboxkit.drivers import pymysql_adapter
from outboxkit.drivers.base import Statement, dbapi_params
from outboxkit.drivers.dbapi_adapter import DBAPIAsync


def _escapes_bytes() -> bool:
    """Whether aiomysql's own ``escape()`` works for bytes with the PyMySQL installed."""
    try:
        from aiomysql import connection
    except ImportError:  # pragma: no cover - no aiomysql, no aiomysql connection either
        return True
    return callable(getattr(connection, "escape_bytes_prefixed", None))


def _quiet_cursor() -> type:
    import aiomysql

    class QuietCursor(aiomysql.Cursor):  # type: ignore[misc]
        async def _show_warnings(self, conn: Any) -> None:
            return None

    return QuietCursor


class AiomysqlAsync(DBAPIAsync):
    label = "aiomysql connection"
    modules = ("aiomysql",)
    backend = "mariadb"
    connection_class = ("aiomysql.connection", "Connection")

    def __init__(self) -> None:
        self._escapes_bytes: bool | None = None  # learnt at the first statement
        self._cursor_class: type | None = None

    def cursor(self, conn: Any) -> Any:
        if self._cursor_class is None:
            self._cursor_class = _quiet_cursor()
        return conn.cursor(self._cursor_class)

    def check(self, conn: Any) -> None:
        pymysql_adapter.check_in_transaction(conn, "aiomysql", closed=conn.closed)

    def needs_begin(self, conn: Any) -> bool:
        return pymysql_adapter.needs_begin(conn, "aiomysql", closed=conn.closed)

    def query(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> tuple[str, Any]:
        if self._escapes_bytes is None:
            self._escapes_bytes = _escapes_bytes()
        values = dbapi_params(params)
        if self._escapes_bytes:
            return stmt.text, values
        return stmt.text % tuple(_literal(conn, v) for v in values), None


def _literal(conn: Any, value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return f"_binary X'{value.hex()}'"
    return str(conn.escape(value))
