"""`outboxkit migrate --dsn mysql://…` on the private MariaDB: the outbox and the inbox."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymysql
import pytest
from click.testing import CliRunner

from outboxkit.ops.cli.app import main
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import own_database


@pytest.fixture
def mariadb_url(mariadb_server: MariaDB) -> Iterator[str]:
    """A database of this test's own on the private MariaDB; its mysql:// URL."""
    with own_database(mariadb_server, "t") as url:
        yield url


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _columns(url: str, table: str) -> list[str]:
    conn = pymysql.connect(**_args(url))
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT * FROM {table} LIMIT 0")
            return [d[0] for d in cur.description]
    finally:
        conn.close()


def _args(url: str) -> dict[str, Any]:
    from outboxkit.backends.mariadb.sql import connect_args

    return connect_args(url)


def test_migrate_creates_the_outbox_with_postgresql_columns_and_is_idempotent(
    mariadb_url: str,
) -> None:
    first = cli("migrate", "--dsn", mariadb_url)
    assert first.exit_code == 0, first.output
    assert "migrated to schema version 1" in first.output
    again = cli("migrate", "--dsn", mariadb_url.replace("mysql://", "mariadb://"))
    assert again.exit_code == 0, again.output
    assert "up to date" in again.output
    assert _columns(mariadb_url, "outbox") == [
        "id", "event_id", "topic", "key", "event_type", "aggregate_type", "aggregate_id",
        "payload", "headers", "status", "attempts", "available_at", "claim_token", "claimed_by",
        "last_error", "created_at", "published_at", "occurred_at", "schema_version",
    ]  # fmt: skip


def test_migrate_inbox_makes_the_pair_a_dedup_key(mariadb_url: str) -> None:
    result = cli("migrate", "--inbox", "--dsn", mariadb_url)
    assert result.exit_code == 0, result.output
    conn = pymysql.connect(**_args(mariadb_url), autocommit=True)
    try:
        with conn.cursor() as cur:
            row = ("billing", "0190a1b2-0000-7000-8000-000000000001")
            cur.execute(
                "INSERT INTO processed_events (consumer_name, event_id) VALUES (%s, %s)", row
            )
            with pytest.raises(pymysql.err.IntegrityError):
                cur.execute(
                    "INSERT INTO processed_events (consumer_name, event_id) VALUES (%s, %s)", row
                )
    finally:
        conn.close()


def test_migrate_tasks_creates_the_task_table_and_its_side_tables_once(mariadb_url: str) -> None:
    result = cli("migrate", "--tasks", "--dsn", mariadb_url)
    assert result.exit_code == 0, result.output
    assert "migrated to schema version 2" in result.output
    again = cli("migrate", "--tasks", "--dsn", mariadb_url)
    assert again.exit_code == 0 and "up to date" in again.output, again.output
    conn = pymysql.connect(**_args(mariadb_url), autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW TABLES")
            tables = {r[0] for r in cur.fetchall()}
            cur.execute("SELECT COUNT(*) FROM outboxkit_tasks_key_locks")
            (locks,) = cur.fetchone()
    finally:
        conn.close()
    assert {"outboxkit_tasks", "outboxkit_tasks_queues", "outboxkit_tasks_deps",
            "outboxkit_tasks_limits", "outboxkit_tasks_key_rates",
            "outboxkit_schedules"} <= tables  # fmt: skip
    assert locks == 65536
    printed = cli("migrate", "--tasks", "--print-sql", "--dsn", mariadb_url)
    assert printed.exit_code == 0 and "live_queue" in printed.output, printed.output


def test_migrate_refuses_what_mariadb_has_not_in_one_line(mariadb_url: str) -> None:
    bad = cli("migrate", "--table", "out;box", "--dsn", mariadb_url)
    assert bad.exit_code == 2
    assert "not a plain MariaDB identifier" in bad.output


def test_migrate_print_sql_gives_mariadb_ddl(mariadb_url: str) -> None:
    result = cli("migrate", "--print-sql", "--dsn", mariadb_url)
    assert result.exit_code == 0, result.output
    assert "AUTO_INCREMENT" in result.output
    assert "FOR UPDATE" not in result.output


def test_migrate_reports_an_unreachable_server_without_a_traceback() -> None:
    result = cli("migrate", "--dsn", "mysql://root@127.0.0.1:1/shop")
    assert result.exit_code == 3  # as PostgreSQL's "cannot reach the database"
    assert "cannot reach MariaDB" in result.output


def test_migrate_ordered_adds_the_partitions_the_leases_and_the_key_locks(
    mariadb_url: str,
) -> None:
    result = cli("migrate", "--ordered", "--partitions", "16", "--dsn", mariadb_url)
    assert result.exit_code == 0, result.output
    assert "ordered table 'outbox' migrated" in result.output
    again = cli("migrate", "--ordered", "--dsn", mariadb_url)
    assert again.exit_code == 0 and "up to date" in again.output
    assert "partition" in _columns(mariadb_url, "outbox")
    conn = pymysql.connect(**_args(mariadb_url))
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) FROM outbox_partitions")
            assert cur.fetchone()[0] == 16  # P as given; a later run keeps it
            cur.execute("SELECT COUNT(*) FROM outbox_key_locks")
            assert cur.fetchone()[0] == 65536
    finally:
        conn.close()
    assert "relay_id" in _columns(mariadb_url, "outbox_relays")


def test_migrate_ordered_prints_its_sql_and_refuses_a_bad_count() -> None:
    url = "mysql://app@127.0.0.1:1/shop"  # --print-sql connects to nothing
    printed = cli("migrate", "--ordered", "--partitions", "8", "--print-sql", "--dsn", url)
    assert printed.exit_code == 0, printed.output
    assert "CRC32(`key`) % 8" in printed.output and "`outbox_key_locks`" in printed.output
    assert cli("migrate", "--partitions", "8", "--dsn", url).exit_code == 2
    bad = cli("migrate", "--ordered", "--partitions", "0", "--print-sql", "--dsn", url)
    assert bad.exit_code == 2 and "1<=x<=32767" in bad.output  # (the option's own range)
