"""psycopg2 ``connection``: a plain DB-API connection (Django's psycopg2 backend, scripts).

Under SQLAlchemy the SQLAlchemy adapter keeps running the statement through
``exec_driver_sql`` (``joins`` stays False), as it did before this adapter existed.
"""

from __future__ import annotations

from typing import Any

from outboxkit.drivers.dbapi_adapter import DBAPISync
from outboxkit.errors import NotInTransactionError

# psycopg2.extensions.TRANSACTION_STATUS_*: the libpq values, as psycopg 3's TransactionStatus.
_INTRANS = 2
_INERROR = 3


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


class Psycopg2Sync(DBAPISync):
    label = "psycopg2 connection"
    modules = ("psycopg2",)
    connection_class = ("psycopg2.extensions", "connection")

    def check(self, conn: Any) -> None:
        check_in_transaction(conn)
