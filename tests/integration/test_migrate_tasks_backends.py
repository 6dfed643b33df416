"""``outboxkit.tasks.migrate_tasks`` runs through the backend its URL names.

It was PostgreSQL's function re-exported: a ``mysql://`` URL went to libpq, which refused
it ("missing "=" after "mysql://…" in connection info string"), while ``outboxkit migrate
--tasks`` on the same URL built MariaDB's task tables.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pymysql
import pytest

from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.backends.postgres.migrate import MigrationAction, MigrationResult
from outboxkit.backends.postgres.migrate import migrate_tasks as pg_migrate_tasks
from outboxkit.tasks import migrate_tasks
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import own_database


@pytest.fixture
def mariadb_url(mariadb_server: MariaDB) -> Iterator[str]:
    with own_database(mariadb_server, "mt") as url:
        yield url


def test_postgresql_s_function_alone_cannot_read_a_mariadb_url(mariadb_url: str) -> None:
    with pytest.raises(psycopg.ProgrammingError, match='missing "=" after'):
        pg_migrate_tasks(mariadb_url)


def test_the_public_migrate_tasks_builds_mariadb_s_task_tables(mariadb_url: str) -> None:
    first = migrate_tasks(mariadb_url)
    assert "migrated to schema version" in first.describe()
    assert "up to date" in migrate_tasks(mariadb_url).describe()
    conn = pymysql.connect(**connect_args(mariadb_url))
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW TABLES")
            tables = {r[0] for r in cur.fetchall()}
    finally:
        conn.close()
    assert {"outboxkit_tasks", "outboxkit_schedules"} <= tables


def test_on_postgresql_it_returns_what_it_always_did(empty_db_dsn: str) -> None:
    first = migrate_tasks(empty_db_dsn, table="jobs")
    assert isinstance(first, MigrationResult) and first.action is MigrationAction.CREATED
    again = migrate_tasks(empty_db_dsn, table="jobs")
    assert isinstance(again, MigrationResult) and again.action is MigrationAction.UNCHANGED
