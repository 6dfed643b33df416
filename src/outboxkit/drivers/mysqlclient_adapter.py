"""mysqlclient (``MySQLdb``) ``Connection``: Django's MySQL driver, a DB-API connection.

Refused as PyMySQL is (closed, or autocommit with no transaction open). mysqlclient does
not expose the server's status flags, so on an autocommit connection (the rare case: Django
runs with autocommit on and opens transactions with ``atomic()``) the check asks the server
(``@@in_transaction``); with autocommit off it costs nothing.
"""

from __future__ import annotations

from typing import Any

from outboxkit.drivers.dbapi_adapter import DBAPISync
from outboxkit.errors import NotInTransactionError


def needs_begin(conn: Any) -> bool:
    """Whether the connection is in autocommit mode with no transaction open; refuses a
    closed one."""
    if not conn.open:
        raise NotInTransactionError("the mysqlclient (MySQLdb) connection is closed")
    if not conn.get_autocommit():
        return False
    with conn.cursor() as cur:
        cur.execute("SELECT @@in_transaction")
        row = cur.fetchone()
    return not (row and row[0])


def check_in_transaction(conn: Any) -> None:
    """Refuse a closed connection, or autocommit with no transaction open."""
    if needs_begin(conn):
        raise NotInTransactionError(
            "the mysqlclient (MySQLdb) connection is in autocommit mode with no transaction"
            " open; run BEGIN (or turn autocommit off) so the event commits with your change"
        )


class MySQLdbSync(DBAPISync):
    label = "mysqlclient (MySQLdb) connection"
    modules = ("MySQLdb",)
    backend = "mariadb"
    connection_class = ("MySQLdb.connections", "Connection")
    joins_sqlalchemy = (
        True  # MySQL begins implicitly: the connection's transaction is the session's
    )

    def check(self, conn: Any) -> None:
        check_in_transaction(conn)

    def needs_begin(self, conn: Any) -> bool:
        return needs_begin(conn)
