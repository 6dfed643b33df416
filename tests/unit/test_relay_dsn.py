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
