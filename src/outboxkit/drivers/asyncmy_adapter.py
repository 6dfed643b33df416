"""asyncmy ``Connection`` (MariaDB/MySQL, async; Cython): PyMySQL's state, its own names.

Refused as PyMySQL is: closed (``connected`` false), or autocommit with no transaction
open (``await conn.begin()`` opens one).
"""

from __future__ import annotations

from typing import Any

from outboxkit.drivers import pymysql_adapter
from outboxkit.drivers.dbapi_adapter import DBAPIAsync


class AsyncmyAsync(DBAPIAsync):
    label = "asyncmy connection"
    modules = ("asyncmy",)
    backend = "mariadb"
    connection_class = ("asyncmy.connection", "Connection")

    def check(self, conn: Any) -> None:
        pymysql_adapter.check_in_transaction(conn, "asyncmy", closed=not conn.connected)

    def needs_begin(self, conn: Any) -> bool:
        return pymysql_adapter.needs_begin(conn, "asyncmy", closed=not conn.connected)
