"""PyMySQL ``Connection`` (MariaDB/MySQL): a DB-API connection, told apart by class.

Refused outside a transaction as psycopg is: a closed connection, or autocommit with no
transaction open (each statement would commit alone). With autocommit off the server
opens the transaction with the first statement, as psycopg2 does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outboxkit.drivers.base import CursorCache, Statement, SyncAdapter, dbapi_params
from outboxkit.errors import NotInTransactionError

_SERVER_STATUS_IN_TRANS = 1  # pymysql.constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS


def _is_pymysql_connection(conn_type: type) -> bool:
    return any(
        c.__module__ == "pymysql.connections" and c.__name__ == "Connection"
        for c in conn_type.__mro__
    )


def check_in_transaction(conn: Any) -> None:
    """Refuse a closed connection, or autocommit with no transaction open."""
    if not conn.open:
        raise NotInTransactionError("the PyMySQL connection is closed")
    if conn.get_autocommit() and not conn.server_status & _SERVER_STATUS_IN_TRANS:
        raise NotInTransactionError(
            "the PyMySQL connection is in autocommit mode with no transaction open;"
            " call conn.begin() (or turn autocommit off) so the event commits with your change"
        )


class PyMySQLSync(SyncAdapter):
    label = "PyMySQL connection"
    modules = ("pymysql",)

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        return _is_pymysql_connection(conn_type)

    def check(self, conn: Any) -> None:
        check_in_transaction(conn)

    def execute(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        check_in_transaction(conn)
        self.run(conn, stmt, params, cursors)

    def fetch_flag(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> bool:
        check_in_transaction(conn)
        return self.run_fetch_flag(conn, stmt, params)

    def run(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        with conn.cursor() as cur:
            cur.execute(stmt.text, dbapi_params(params))

    def run_fetch_flag(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> bool:
        with conn.cursor() as cur:
            cur.execute(stmt.text, dbapi_params(params))
            row = cur.fetchone()
        return bool(row and row[0])
