"""Django's Tasks framework and the app's task mode on a project whose database is MariaDB
(Django's ``mysql`` backend, mysqlclient): ``manage.py migrate`` creates the task table,
an enqueue rides in the caller's ``atomic()`` block (rolled back: never runs), in autocommit
it is written at once, ``manage.py outboxkit_worker`` runs the tasks, ``get_result`` reads
them back. In a child process: this suite's Django is configured once, on PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from outboxkit.backends import backend_for
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database, driver_module
from tests.support.mariadb_ops import mariadb_execute


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    with database(mariadb_server, "djt") as url:  # empty: manage.py migrate makes the tables
        yield url


def test_framework_tasks_on_mariadb_ride_the_callers_transaction_and_run_by_the_worker(
    url: str, tmp_path: Path
) -> None:
    driver_module("MySQLdb")  # Django's mysql backend
    driver_module("django_tasks" if sys.version_info < (3, 12) else "django")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django_mariadb_settings",
        "OUTBOXKIT_TEST_DJANGO_MYSQL_URL": url,
        "OUTBOXKIT_TEST_WORKER_LOG": str(tmp_path / "worker.log"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.contrib.django_mariadb_tasks"],
        env=env, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    log = (tmp_path / "worker.log").read_text() if (tmp_path / "worker.log").exists() else ""
    assert done.returncode == 0, done.stderr + log
    seen = json.loads(done.stdout)
    ids = seen.pop("ids")
    assert ids.pop("driver") == "MySQLdb.connections"
    # written before the worker started: committed and autocommit, both waiting
    assert seen.pop("pending") == {"committed": "READY", "autocommit": "READY"}
    assert seen == {
        "committed": ["SUCCESSFUL", 5, []],
        "context": ["SUCCESSFUL", 1, []],  # takes_context: the first attempt
        "failing": [
            "FAILED",
            None,
            ["tests.integration.contrib.django_framework_tasks.ReportFailed"],
        ],
        "autocommit": ["SUCCESSFUL", 42, []],  # an async @task, enqueued outside atomic()
        "rolled_back": "TaskResultDoesNotExist",
        "own_committed": ["done", "noted committed"],
    }, log
    # The rolled-back enqueues (Django's and the app's own) left no row behind.
    names = mariadb_execute(url, "SELECT task_name, payload FROM outboxkit_tasks ORDER BY id")
    assert [n for n, _ in names].count("django.task") == 4
    assert [json.loads(p) for n, p in names if n == "mariadb.note"] == [{"n": "committed"}]
    # manage.py migrate recorded what it made: outboxkit migrate finds nothing to do.
    backend = backend_for(url)
    for kind, table in (("outbox", "outbox"), ("inbox", "processed_events"),
                        ("tasks", "outboxkit_tasks")):  # fmt: skip
        assert "up to date" in backend.migrate(url, kind, table).describe()  # type: ignore[arg-type]


def test_the_apps_migrations_on_mariadb_drop_their_tables_at_zero_and_make_them_again(
    url: str,
) -> None:
    """Before, ``manage.py migrate`` ran PostgreSQL's DDL on MariaDB and failed at 0001;
    now each migration runs MariaDB's files, recorded, and reverses them."""
    driver_module("MySQLdb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django_mariadb_settings",
        "OUTBOXKIT_TEST_DJANGO_MYSQL_URL": url,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.contrib.django_mariadb_migrations"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    made, zero, again = json.loads(done.stdout)
    assert made == again
    assert {"outbox", "processed_events", "outboxkit_tasks", "outboxkit_schedules"} <= set(
        made["tables"]
    )
    assert made["records"] == [
        "inbox:processed_events:1", "outbox:outbox:1", "tasks:outboxkit_tasks:1",
        "tasks:outboxkit_tasks:2",
    ]  # fmt: skip
    assert zero == {"tables": ["outboxkit_schema_versions"], "records": []}
