"""A DB-API 2 driver connection (psycopg2, PyMySQL).

These drivers share one shape: the connection's class names the driver (matched along
its MRO, so the optional driver is never imported), a statement runs through a cursor
with the parameters as the DB-API takes them, and only "is a transaction open?" differs:
each driver's adapter supplies ``check``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from outboxkit.drivers.base import CursorCache, Statement, SyncAdapter, dbapi_params


def _is_connection_class(conn_type: type, module: str, name: str) -> bool:
    return any(c.__module__ == module and c.__name__ == name for c in conn_type.__mro__)


class DBAPISync(SyncAdapter):
    """A sync DB-API driver: ``check`` is the driver's; the rest runs through a cursor."""

    #: (module, class name) of the driver's connection class.
    connection_class: ClassVar[tuple[str, str]]

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        return _is_connection_class(conn_type, *cls.connection_class)

    def execute(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        self.check(conn)
        self.run(conn, stmt, params, cursors)

    def fetch_flag(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> bool:
        self.check(conn)
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
