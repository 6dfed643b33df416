"""psycopg2 ``connection``: a plain DB-API connection (Django's psycopg2 backend, scripts).

Told apart by class, without importing psycopg2 (an optional dependency). Under
SQLAlchemy the SQLAlchemy adapter keeps running the statement through
``exec_driver_sql`` (``joins`` stays False), as it did before this adapter existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outboxkit.drivers.base import CursorCache, Statement, SyncAdapter, dbapi_params
from outboxkit.errors import NotInTransactionError

# psycopg2.extensions.TRANSACTION_STATUS_*: the libpq values, as psycopg 3's TransactionStatus.
_INTRANS = 2
_INERROR = 3


def _is_psycopg2_connection(conn_type: type) -> bool:
    return any(
        c.__module__ == "psycopg2.extensions" and c.__name__ == "connection"
        for c in conn_type.__mro__
    )


def check_in_transaction(conn: Any) -> None:
    """Refuse a closed connection, a failed transaction, or autocommit outside a block."""
    if conn.closed:
        raise NotInTransactionError("the psycopg2 connection is closed")
    status = conn.info.transaction_status
    if status == _INERROR:
        raise NotInTransactionError(
            "the transaction has already failed (an earlier statement raised);"
            " roll back and retry the whole unit of work"
        )
    # Without autocommit psycopg2 opens the transaction with the first statement.
    if conn.autocommit and status != _INTRANS:
        raise NotInTransactionError(
            "the psycopg2 connection is in autocommit mode with no transaction open;"
            " turn autocommit off (or run BEGIN) so the event commits with your change"
        )


class Psycopg2Sync(SyncAdapter):
    label = "psycopg2 connection"
    modules = ("psycopg2",)

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        return _is_psycopg2_connection(conn_type)

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
