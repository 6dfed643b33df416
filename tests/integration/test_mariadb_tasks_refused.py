"""What task mode does not do on MariaDB/MySQL yet is refused where it starts, in one line
naming what is missing, before anything is written or started: the task commands and the
worker's task gauges (``task_admin``), lifecycle events written by the settle
(``task_events``), limits per key (``task_key_limits``: a claim that ignored them would run
a key's tasks past its limit). The worker and enqueue themselves run
(test_mariadb_tasks_end_to_end.py)."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from outboxkit.backends.mariadb.backend import MARIADB
from outboxkit.errors import ConfigurationError
from outboxkit.ops.cli import main
from outboxkit.tasks import Tasks, Worker
from tests.support.mariadb import MariaDB

ADMIN = MARIADB.cannot["task_admin"]

tasks = Tasks()


@tasks.handler("report.generate", events="task-events")
def generate(payload: Any) -> None:
    """A handler whose lifecycle events the MariaDB worker does not write."""


def test_a_worker_of_handlers_with_lifecycle_events_is_refused_in_one_line(
    mariadb_server: MariaDB,
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        Worker(tasks, mariadb_server.url_for("shop"))
    assert str(refused.value) == MARIADB.cannot["task_events"]


@pytest.mark.parametrize(
    "limit",
    [{"concurrency_per_key": 2}, {"rate_per_key": "5/s"}, {"fair": True}],
    ids=["concurrency", "rate", "fair"],
)
def test_a_worker_of_handlers_with_limits_per_key_is_refused_in_one_line(
    mariadb_server: MariaDB, limit: dict[str, Any]
) -> None:
    keyed = Tasks()

    @keyed.handler("sms.send", **limit)
    def send(payload: Any) -> None:
        """A handler whose per-key limit MariaDB's claim does not keep."""

    with pytest.raises(ConfigurationError) as refused:
        Worker(keyed, mariadb_server.url_for("shop"))
    assert str(refused.value) == MARIADB.cannot["task_key_limits"]


def test_every_task_command_and_the_workers_task_gauges_refuse_a_mysql_url_in_one_line(
    mariadb_server: MariaDB,
) -> None:
    url = mariadb_server.url_for("shop")
    runner = CliRunner()
    commands = [
        ["worker", "--app", "tests.support.tasks_app:tasks", "--metrics-port", "0"],
        ["tasks", "list"],
        ["tasks", "failed"],
        ["tasks", "replay", "--all"],
        ["tasks", "purge", "--older-than", "1d"],
    ]
    for args in commands:
        result = runner.invoke(main, [*args, "--dsn", url])
        assert result.exit_code == 2, (args, result.output)
        assert result.output == f"error: {ADMIN}\n", (args, result.output)
    assert "\n" not in ADMIN
