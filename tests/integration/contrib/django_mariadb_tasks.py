"""Run by test_django_mariadb_tasks.py in a project on MariaDB (django_mariadb_settings):
``manage.py migrate``; Django's ``@task`` and the app's own ``tasks.enqueue`` rolled back,
committed and (``@task``) in autocommit; ``manage.py outboxkit_worker`` as a child process
until every result is finished; ``get_result`` of each. Prints one JSON object."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from outboxkit.contrib.django import tasks  # noqa: E402
from tests.integration.contrib import django_framework_tasks as jobs  # noqa: E402
from tests.integration.contrib import django_mariadb_jobs  # noqa: E402, F401
from tests.support.django_worker import run_until_finished  # noqa: E402


def enqueue() -> dict[str, Any]:
    ids: dict[str, Any] = {}
    try:
        with transaction.atomic():
            ids["rolled_back"] = jobs.add.enqueue(1, 1).id
            ids["own_rolled_back"] = tasks.enqueue("mariadb.note", {"n": "rolled back"})
            raise RuntimeError("the view failed")
    except RuntimeError:
        pass
    with transaction.atomic():
        ids["committed"] = jobs.add.enqueue(2, 3).id
        ids["context"] = jobs.attempt.enqueue().id
        ids["failing"] = jobs.fail.enqueue().id
        ids["own_committed"] = tasks.enqueue("mariadb.note", {"n": "committed"})
        ids["driver"] = type(connection.connection).__module__
    ids["autocommit"] = jobs.add_async.enqueue(20, 22).id
    return ids


def run_worker(results: list[Any], log: Path) -> None:
    """``manage.py outboxkit_worker`` until every result is finished."""
    app = "tests.integration.contrib.django_mariadb_jobs:tasks"
    argv = [sys.executable, "-m", "django", "outboxkit_worker", "--retention", "keep",
            "--poll-interval", "0.1", "--app", app]  # fmt: skip
    run_until_finished(argv, results, log, timeout=30)


def main() -> None:
    call_command("migrate", verbosity=0)
    ids = enqueue()
    backend = jobs.add.get_backend()
    pending = {k: backend.get_result(ids[k]).status.name for k in ("committed", "autocommit")}
    results = {
        k: backend.get_result(ids[k]) for k in ("committed", "context", "failing", "autocommit")
    }
    run_worker(list(results.values()), Path(os.environ["OUTBOXKIT_TEST_WORKER_LOG"]))
    seen: dict[str, Any] = {"ids": ids, "pending": pending}
    for name, r in results.items():
        seen[name] = [r.status.name, r.return_value if r.status.name == "SUCCESSFUL" else None,
                      [e.exception_class_path for e in r.errors]]  # fmt: skip
    try:
        backend.get_result(ids["rolled_back"])
    except Exception as exc:
        seen["rolled_back"] = type(exc).__name__
    own = tasks.tasks.result(connection.connection, ids["own_committed"])
    seen["own_committed"] = None if own is None else [own.status, own.value]
    print(json.dumps(seen))


main()
