"""Task mode on MariaDB/MySQL is refused at every entry point, in one line naming what is
missing, before anything is written or started (issue 23: "through the same backend
interface, or refused with a clear message naming what is missing")."""

from __future__ import annotations

from typing import Any

import pymysql
import pytest
from click.testing import CliRunner

from outboxkit.backends.mariadb.backend import NO_TASKS as MISSING
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import ConfigurationError
from outboxkit.ops.cli import main
from outboxkit.tasks import Tasks, Worker
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import mariadb_execute, new_database

tasks = Tasks()


@tasks.handler("report.generate")
def generate(payload: Any) -> None:
    """A handler that must never run on MariaDB."""


def test_enqueue_through_a_pymysql_connection_is_refused_and_writes_nothing(
    mariadb_server: MariaDB,
) -> None:
    url = new_database(mariadb_server)
    conn = pymysql.connect(**connect_args(url))
    try:
        conn.begin()
        mariadb_execute(url, "CREATE TABLE marker (n INT)")
        with conn.cursor() as cur:
            cur.execute("INSERT INTO marker VALUES (1)")
        # Naively, PostgreSQL's ENQUEUE would reach MariaDB and fail with a syntax error
        # about `ON CONFLICT` or `$1` - a message that names nothing the user can do.
        with pytest.raises(ConfigurationError) as refused:
            tasks.enqueue(conn, "report.generate", {"n": 1})
        assert str(refused.value) == MISSING
        conn.commit()  # the caller's own transaction is untouched and still commits
    finally:
        conn.close()
    assert mariadb_execute(url, "SELECT n FROM marker") == [(1,)]
    tables = {r[0] for r in mariadb_execute(url, "SHOW TABLES")}
    assert "outboxkit_tasks" not in tables


def test_the_worker_and_every_task_command_refuse_a_mysql_url_in_one_line(
    mariadb_server: MariaDB,
) -> None:
    url = mariadb_server.url_for("shop")
    with pytest.raises(ConfigurationError, match="task mode is not available on MariaDB"):
        Worker(tasks, url)
    runner = CliRunner()
    commands = [
        ["worker", "--app", "tests.support.tasks_app:tasks"],
        ["migrate", "--tasks"],
        ["tasks", "list"],
        ["tasks", "failed"],
        ["tasks", "replay", "--all"],
        ["tasks", "purge", "--older-than", "1d"],
    ]
    for args in commands:
        result = runner.invoke(main, [*args, "--dsn", url])
        assert result.exit_code == 2, (args, result.output)
        assert result.output == f"error: {MISSING}\n", (args, result.output)
