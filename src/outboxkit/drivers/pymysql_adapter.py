"""PyMySQL ``Connection`` (MariaDB/MySQL): a DB-API connection, told apart by class.

Refused outside a transaction as psycopg is: a closed connection, or autocommit with no
transaction open (each statement would commit alone). With autocommit off the server
opens the transaction with the first statement, as psycopg2 does.
"""

from __future__ import annotations

from typing import Any

from outboxkit.drivers.dbapi_adapter import DBAPISync
from outboxkit.errors import NotInTransactionError

_SERVER_STATUS_IN_TRANS = 1  # pymysql.constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS


def check_in_transaction(conn: Any) -> None:
    """Refuse a closed connection, or autocommit with no transaction open."""
    if not conn.open:
        raise NotInTransactionError("the PyMySQL connection is closed")
    if conn.get_autocommit() and not conn.server_status & _SERVER_STATUS_IN_TRANS:
        raise NotInTransactionError(
            "the PyMySQL connection is in autocommit mode with no transaction open;"
            " call conn.begin() (or turn autocommit off) so the event commits with your change"
        )


class PyMySQLSync(DBAPISync):
    label = "PyMySQL connection"
    modules = ("pymysql",)
    connection_class = ("pymysql.connections", "Connection")

    def check(self, conn: Any) -> None:
        check_in_transaction(conn)
