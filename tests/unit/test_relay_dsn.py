"""An embedded Relay refuses a DSN libpq cannot parse at construction, password masked."""

from __future__ import annotations

import pytest

from outboxkit import ConfigurationError, Relay, from_url


@pytest.mark.parametrize(
    "dsn", ["postgresql://app:S3cret%ZZpass@127.0.0.1/x", "postgres//app:S3cretpass@127.0.0.1/x"]
)
def test_a_relay_with_a_malformed_dsn_fails_at_construction_in_one_line(dsn: str) -> None:
    """Before: a traceback from the relay's listen task, quoting the password."""
    with pytest.raises(ConfigurationError) as caught:
        Relay(dsn, from_url("nats://127.0.0.1:1"))
    message = str(caught.value)
    assert "not a valid PostgreSQL connection string" in message, message
    assert "S3cret" not in message and "\n" not in message, message


@pytest.mark.parametrize(
    ("message", "fix"),
    [
        ('connection failed: ... FATAL:  database "shop" does not exist', "database name"),
        ('connection failed: ... FATAL:  role "app" does not exist', "user name"),
        (
            'connection failed: ... FATAL:  password authentication failed for user "app"',
            "password",
        ),
        ('connection failed: ... FATAL:  no pg_hba.conf entry for host "10.0.0.5"', "pg_hba.conf"),
        ("connection failed: ... Connection refused", None),
        ("connection failed: ... timeout expired", None),
    ],
)
def test_configuration_faults_are_told_from_outages(message: str, fix: str | None) -> None:
    """libpq reports these at connect without a SQLSTATE: its FATAL message is read (28P01
    and pg_hba need a server with password auth, which the test servers do not have)."""
    import psycopg

    from outboxkit.backends.postgres._connection import configuration_fault

    found = configuration_fault(psycopg.OperationalError(message))
    assert (found is None) if fix is None else (found is not None and fix in found), found
