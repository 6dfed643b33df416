"""What task mode does not do on MariaDB/MySQL yet is refused where it starts, in one line
naming what is missing, before anything is written or started: lifecycle events written by
the settle (``task_events``). The worker, enqueue, the task commands, the dashboard's Tasks
page and the per-key controls run (test_mariadb_tasks_end_to_end.py,
test_task_commands_both_databases.py, test_mariadb_dashboard_tasks.py,
test_mariadb_tasks_key_limits.py)."""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit.backends.mariadb.backend import MARIADB
from outboxkit.errors import ConfigurationError
from outboxkit.tasks import Tasks, Worker
from tests.support.mariadb import MariaDB

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
