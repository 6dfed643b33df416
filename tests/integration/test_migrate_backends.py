"""``outboxkit.migrate`` and ``outboxkit.migrate_inbox`` run through the backend their URL
names.

They were PostgreSQL's functions re-exported: a ``mysql://`` URL went to libpq, which refused
it, while ``outboxkit migrate`` (and ``--inbox``) on the same URL built MariaDB's tables.
What MariaDB cannot do (``partition_by``) is refused by its backend's one line.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pymysql
import pytest

import outboxkit
from outboxkit.backends.mariadb.backend import MARIADB
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.backends.postgres.migrate import MigrationAction, MigrationResult
from outboxkit.backends.postgres.migrate import migrate as pg_migrate
from outboxkit.errors import ConfigurationError, SchemaError
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import own_database


@pytest.fixture
def mariadb_url(mariadb_server: MariaDB) -> Iterator[str]:
    with own_database(mariadb_server, "mg") as url:
        yield url


def _tables(url: str) -> set[str]:
    conn = pymysql.connect(**connect_args(url))
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW TABLES")
            return {r[0] for r in cur.fetchall()}
    finally:
        conn.close()


def test_postgresql_s_function_alone_cannot_read_a_mariadb_url(mariadb_url: str) -> None:
    with pytest.raises(psycopg.ProgrammingError, match='missing "=" after'):
        pg_migrate(mariadb_url)


def test_the_public_functions_build_mariadb_s_tables(mariadb_url: str) -> None:
    assert "migrated to schema version" in outboxkit.migrate(mariadb_url).describe()
    assert "up to date" in outboxkit.migrate(mariadb_url).describe()
    ordered = outboxkit.migrate(mariadb_url, table="keyed", ordered=True, partitions=8)
    assert "keyed" in ordered.describe()
    outboxkit.migrate_inbox(mariadb_url)
    assert {"outbox", "keyed", "processed_events"} <= _tables(mariadb_url)


def test_postgresql_only_options_are_refused_on_mariadb_by_its_backend(mariadb_url: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        outboxkit.migrate(mariadb_url, partition_by="day")
    assert str(refused.value) == MARIADB.cannot["partition_by"]
    with pytest.raises(SchemaError, match="apply to ordered mode"):
        outboxkit.migrate(mariadb_url, partitions=8)
    assert "outbox" not in _tables(mariadb_url)  # refused before anything was created


def test_on_postgresql_they_return_what_they_always_did(empty_db_dsn: str) -> None:
    first = outboxkit.migrate(empty_db_dsn, table="events", ordered=True, partitions=4)
    assert isinstance(first, MigrationResult) and first.action is MigrationAction.CREATED
    again = outboxkit.migrate(empty_db_dsn, table="events", ordered=True)
    assert isinstance(again, MigrationResult) and again.action is MigrationAction.UNCHANGED
    inbox = outboxkit.migrate_inbox(empty_db_dsn, table="seen")
    assert isinstance(inbox, MigrationResult) and inbox.action is MigrationAction.CREATED
    with pytest.raises(SchemaError, match="apply to ordered mode"):
        outboxkit.migrate(empty_db_dsn, repartition=True)
    # An empty partition_by is refused as PostgreSQL's function refused it (a dispatch
    # that passed it on only when truthy quietly made a plain table).
    with pytest.raises(ConfigurationError, match="must be 'day' or 'hour'"):
        outboxkit.migrate(empty_db_dsn, table="other", partition_by="")
