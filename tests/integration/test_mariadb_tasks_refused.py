"""What task mode does not do on MariaDB/MySQL yet is refused where it starts, in one line
naming what is missing, before anything is written or started: the dashboard's Tasks page
(``task_admin``), lifecycle events written by the settle (``task_events``). The worker,
enqueue, the task commands and the per-key controls run (test_mariadb_tasks_end_to_end.py,
test_task_commands_both_databases.py, test_mariadb_tasks_key_limits.py)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from outboxkit.backends.mariadb.backend import MARIADB
from outboxkit.errors import ConfigurationError
from outboxkit.ops.dashboard import Dashboard
from outboxkit.tasks import Tasks, Worker
from tests.integration.test_dashboard import served
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


async def test_the_dashboards_tasks_page_answers_a_mysql_url_with_the_one_line(
    mariadb_server: MariaDB,
) -> None:
    board = Dashboard(mariadb_server.url_for("shop"), sample_interval=60)
    async with served(board) as base, aiohttp.ClientSession() as session:
        async with session.get(f"{base}/api/tasks/overview") as resp:  # the page's banner
            assert (resp.status, (await resp.json())["missing"]) == (200, ADMIN)
        for path in ("/api/tasks?state=failed", "/api/tasks/1", "/api/tasks/queues"):
            async with session.get(f"{base}{path}") as resp:
                assert resp.status == 404, path
                assert await resp.json() == {"error": ADMIN, "missing": True}, path
    assert "\n" not in ADMIN
