"""``outboxkit migrate --fleet`` creates the fleet lease table, so a relay's role needs no
CREATE privilege: without it the first lease check creates the table, and a role that may
not create one cannot join a fleet at all. The same on MariaDB."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest
from click.testing import CliRunner

from outboxkit.backends.mariadb.fleet_leases import MariaDBFleetLease
from outboxkit.backends.postgres.fleet_sql import PgFleetLease
from outboxkit.ops.cli.app import main
from tests.support.mariadb import MariaDB
from tests.support.servers import unique_name


@pytest.fixture
def relay_role(pg_server: Any, empty_db_dsn: str) -> Iterator[str]:
    """A login role that may use the database but not create tables in it (PostgreSQL 15's
    default for public), and may read and write outboxkit_fleet once it exists."""
    role = unique_name("relay")
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {role}")
        conn.execute(f"ALTER DEFAULT PRIVILEGES GRANT ALL ON TABLES TO {role}")
    try:
        yield psycopg.conninfo.make_conninfo(empty_db_dsn, user=role)
    finally:
        with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f"DROP ROLE {role}")


async def test_migrate_fleet_creates_the_lease_table_a_relay_role_cannot(
    empty_db_dsn: str, relay_role: str
) -> None:
    lease = PgFleetLease(relay_role, "relay:outbox", "m1", 5.0)
    # The naive way: the relay's role creates the table on its first check, and may not.
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        await lease.check(want=True)

    runner = CliRunner()
    for said in ("created", "in place"):  # (twice: idempotent)
        result = runner.invoke(main, ["migrate", "--fleet", "--dsn", empty_db_dsn])
        assert result.exit_code == 0, result.output
        assert f"fleet lease table outboxkit_fleet {said}" in result.output

    sighting = await lease.check(want=True)
    assert sighting.owner == "m1" and sighting.members == {"m1"}
    await lease.leave()


def test_migrate_fleet_with_the_task_table_and_in_the_printed_sql(empty_db_dsn: str) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["migrate", "--tasks", "--fleet", "--dsn", empty_db_dsn])
    assert result.exit_code == 0, result.output
    with psycopg.connect(empty_db_dsn) as conn:
        row = conn.execute("SELECT to_regclass('outboxkit_fleet') IS NOT NULL").fetchone()
    assert row == (True,)

    printed = runner.invoke(main, ["migrate", "--print-sql", "--fleet"])
    assert printed.exit_code == 0, printed.output
    assert "CREATE TABLE IF NOT EXISTS outbox" in printed.output
    assert "CREATE TABLE IF NOT EXISTS outboxkit_fleet" in printed.output


def test_migrate_fleet_is_refused_with_the_inbox() -> None:
    result = CliRunner().invoke(
        main, ["migrate", "--fleet", "--inbox", "--dsn", "postgresql://db/x"]
    )
    assert result.exit_code == 2, result.output
    assert "--fleet applies to the outbox and task" in result.output, result.output


async def test_migrate_fleet_on_mariadb_and_status_names_the_owner(
    mariadb_server: MariaDB, tmp_path: Path
) -> None:
    name = unique_name("fleet")
    admin = pymysql.connect(**mariadb_server.connect_args(), autocommit=True)
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
    url = mariadb_server.url_for(name)
    try:
        runner = CliRunner()
        for said in ("created", "in place"):  # (twice: idempotent)
            result = runner.invoke(main, ["migrate", "--fleet", "--dsn", url])
            assert result.exit_code == 0, result.output
            assert f"fleet lease table outboxkit_fleet {said}" in result.output
        with admin.cursor() as cur:
            cur.execute(f"SELECT kind, version FROM {name}.outboxkit_schema_versions")
            assert ("fleet", 1) in set(cur.fetchall())
        printed = runner.invoke(main, ["migrate", "--print-sql", "--fleet", "--dsn", url])
        assert "CREATE TABLE IF NOT EXISTS `outboxkit_fleet`" in printed.output, printed.output

        lease = MariaDBFleetLease(url, "relay:outbox", "host:1:ab", 30.0)
        assert (await lease.check(want=True)).owner == "host:1:ab"
        dsn_file = tmp_path / "databases.txt"
        dsn_file.write_text(f"shop {url}\n")
        shown = runner.invoke(main, ["status", "--dsn-file", str(dsn_file), "--json"])
        assert json.loads(shown.output)["databases"][0]["owner"] == "host:1:ab", shown.output
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")
        admin.close()
