"""PyMySQL ``Connection`` (MariaDB/MySQL): a DB-API connection, told apart by class.

Refused outside a transaction as psycopg is: a closed connection, or autocommit with no
transaction open (each statement would commit alone). With autocommit off the server
opens the transaction with the first statement, as psycopg2 does. aiomysql's connection
keeps PyMySQL's state, so its adapter (``aiomysql_adapter``) asks the same question here.
"""

from __future__ import annotations

from typing import Any

from outboxkit.drivers.dbapi_adapter import DBAPISync
from outboxkit.errors import NotInTransactionError

_SERVER_STATUS_IN_TRANS = 1  # pymysql.constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS
_MULTI_STATEMENTS = 1 << 16  # pymysql.constants.CLIENT.MULTI_STATEMENTS


def needs_begin(conn: Any, driver: str = "PyMySQL", *, closed: bool | None = None) -> bool:
    """Whether the connection is in autocommit mode with no transaction open; refuses a
    closed one."""
    if not conn.open if closed is None else closed:
        raise NotInTransactionError(f"the {driver} connection is closed")
    return bool(conn.get_autocommit() and not conn.server_status & _SERVER_STATUS_IN_TRANS)


def check_in_transaction(conn: Any, driver: str = "PyMySQL", *, closed: bool | None = None) -> None:
    """Refuse a closed connection, or autocommit with no transaction open."""
    if needs_begin(conn, driver, closed=closed):
        raise NotInTransactionError(
            f"the {driver} connection is in autocommit mode with no transaction open;"
            " begin one (or turn autocommit off) so the event commits with your change"
        )


class PyMySQLSync(DBAPISync):
    label = "PyMySQL connection"
    modules = ("pymysql",)
    backend = "mariadb"
    connection_class = ("pymysql.connections", "Connection")
    joins_sqlalchemy = (
        True  # MySQL begins implicitly: the connection's transaction is the session's
    )

    def check(self, conn: Any) -> None:
        check_in_transaction(conn)

    def needs_begin(self, conn: Any) -> bool:
        return needs_begin(conn)

    def multi_statements(self, conn: Any) -> bool:
        # PyMySQL alone leaves it off unless asked (client_flag=CLIENT.MULTI_STATEMENTS).
        return bool(conn.client_flag & _MULTI_STATEMENTS)
