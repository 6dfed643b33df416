"""What the polling relay asks its backend at start, instead of PostgreSQL's modules.

The relay used PostgreSQL's ``refusal`` and ``PartitionChore`` for every database: a
third backend could not say "no time partitions" or read its own driver's faults. Each
backend now answers ``refusal(exc)`` and ``partition_chore(dsn, table)`` (None: none).
"""

from __future__ import annotations

from outboxkit.backends import backend_for
from outboxkit.backends.ports import Backend
from outboxkit.errors import ConfigurationError

PG_URL = "postgresql://u@h/db"
MARIADB_URL = "mysql://u@h/db"


def test_postgresql_reads_its_fatal_connect_messages_as_a_refusal() -> None:
    exc = Exception('FATAL:  database "nope" does not exist')
    refused = backend_for(PG_URL).refusal(exc)
    assert isinstance(refused, ConfigurationError)
    assert "check the database name" in str(refused)
    assert backend_for(PG_URL).refusal(Exception("connection refused")) is None


def test_mariadb_and_the_default_port_retry_every_start_error() -> None:
    exc = Exception('FATAL:  database "nope" does not exist')  # PostgreSQL's words
    assert backend_for(MARIADB_URL).refusal(exc) is None
    assert Backend.refusal(backend_for(MARIADB_URL), exc) is None


def test_only_a_database_with_time_partitions_hands_out_their_chore() -> None:
    chore = backend_for(PG_URL).partition_chore(PG_URL, "outbox")
    assert chore is not None and chore.table == "outbox"
    assert backend_for(MARIADB_URL).partition_chore(MARIADB_URL, "outbox") is None


def test_the_chore_and_the_feature_agree_on_every_backend() -> None:
    for url in (PG_URL, MARIADB_URL):
        backend = backend_for(url)
        assert backend.can("partition_by") == (backend.partition_chore(url, "t") is not None)
