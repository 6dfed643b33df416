"""The one "connection lost" rule and the one "writes denied" rule (outboxkit.errors)."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors as pg_errors

from outboxkit.errors import connection_lost, write_denied


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (psycopg.OperationalError("server closed the connection unexpectedly"), True),
        (psycopg.InterfaceError("the connection is closed"), True),
        (pg_errors.AdminShutdown(), True),  # pg_terminate_backend
        (pg_errors.ConnectionFailure(), True),
        (pg_errors.TooManyConnections(), True),
        (pg_errors.QueryCanceled(), False),  # statement_timeout: an OperationalError too
        (pg_errors.LockNotAvailable(), False),
        (pg_errors.RaiseException(), False),
        (pg_errors.UniqueViolation(), False),
        (pg_errors.InsufficientPrivilege(), False),
        (ConnectionResetError("reset by peer"), True),  # a socket of the replication stream
        (OSError("no route to host"), True),
        (ValueError("not a connection"), False),
    ],
)
def test_only_a_lost_connection_counts_as_a_reconnect(error: Exception, lost: bool) -> None:
    assert connection_lost(error) is lost


def test_psycopg2_errors_follow_the_same_rule() -> None:
    """psycopg2 (the replication stream's driver) names its classes alike, in another module."""
    operational = type("OperationalError", (Exception,), {"__module__": "psycopg2"})
    database = type("DatabaseError", (Exception,), {"__module__": "psycopg2"})
    programming = type("ProgrammingError", (Exception,), {"__module__": "psycopg2"})
    timeout = operational("canceling statement due to statement timeout")
    timeout.pgcode = "57014"  # type: ignore[attr-defined]
    assert connection_lost(operational("server closed the connection"))
    assert connection_lost(database("lost synchronization with server"))
    assert not connection_lost(timeout)
    assert not connection_lost(programming("syntax error"))


@pytest.mark.parametrize(
    ("error", "denied"),
    [
        (pg_errors.InsufficientPrivilege("permission denied for table outbox"), True),
        (pg_errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only tx"), True),
        (pg_errors.UndefinedTable(), False),
        (pg_errors.AdminShutdown(), False),
        (psycopg.OperationalError("gone"), False),
    ],
)
def test_a_missing_privilege_or_a_read_only_server_denies_writes(
    error: Exception, denied: bool
) -> None:
    assert write_denied(error) is denied


def test_a_wrapped_denial_is_read_through_its_cause() -> None:
    wrapper = RuntimeError("statement failed")
    wrapper.__cause__ = pg_errors.InsufficientPrivilege("permission denied")
    assert write_denied(wrapper)
