"""Django's Tasks framework on outboxkit's backend: enqueued in the caller's transaction,
run by ``manage.py outboxkit_worker``, results read back through ``get_result``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("django_tasks")


def _run_worker(
    django_dsn: str, tmp_path: Path, results: list[Any], manage: str = "django"
) -> None:
    """``manage.py outboxkit_worker`` (``python -m manage``) until every result finished."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django_settings",
        "OUTBOXKIT_TEST_DJANGO_DSN": django_dsn,
        "OUTBOXKIT_TEST_SIGNALS_LOG": str(tmp_path / "signals.log"),
    }
    log = tmp_path / "worker.log"
    argv = [sys.executable, "-m", manage, "outboxkit_worker", "--retention", "keep",
            "--poll-interval", "0.2"]  # fmt: skip
    with log.open("wb") as stdout:
        worker = subprocess.Popen(argv, env=env, stdout=stdout, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            for r in results:
                r.refresh()
            if all(r.is_finished for r in results) or worker.poll() is not None:
                break
            time.sleep(0.1)
        assert all(r.is_finished for r in results), log.read_text()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)


def test_framework_tasks_run_in_the_callers_transaction(
    django_dsn: str, django_configured: None, tmp_path: Path
) -> None:
    from django.db import transaction
    from django_tasks import TaskResultStatus
    from django_tasks.exceptions import TaskResultDoesNotExist

    from tests.integration.contrib import django_framework_tasks as jobs

    with pytest.raises(RuntimeError), transaction.atomic():
        lost = jobs.add.enqueue(1, 1)
        raise RuntimeError("rolled back")
    with pytest.raises(TaskResultDoesNotExist):
        jobs.add.get_result(lost.id)
    with transaction.atomic():
        added = jobs.add.enqueue(2, 3)
        with pytest.raises(RuntimeError), transaction.atomic():  # a savepoint rolled back
            inner = jobs.add.enqueue(7, 7)
            raise RuntimeError("the inner block failed")
    with pytest.raises(TaskResultDoesNotExist):
        jobs.add.get_result(inner.id)
    outside = jobs.add_async.enqueue(4, 5)  # autocommit: enqueued at once
    ctx = jobs.attempt.enqueue()
    failed = jobs.fail.enqueue()
    assert added.status == TaskResultStatus.READY and isinstance(added.id, str)
    _run_worker(django_dsn, tmp_path, [added, outside, ctx, failed])
    assert added.status == TaskResultStatus.SUCCESSFUL and added.return_value == 5
    assert outside.return_value == 9
    assert ctx.return_value == 1
    assert failed.status == TaskResultStatus.FAILED
    error = failed.errors[-1]
    assert error.exception_class_path.endswith("django_framework_tasks.ReportFailed")
    assert "the report failed" in error.traceback
    seen = (tmp_path / "signals.log").read_text().splitlines()  # the backport's signals too
    assert f"started {added.id} RUNNING" in seen and f"finished {failed.id} FAILED" in seen


def test_queue_priority_and_run_after_are_the_tasks_and_bad_args_are_refused(
    django_dsn: str, django_configured: None
) -> None:
    import datetime as dt

    import psycopg
    from django.db import transaction
    from django_tasks import TaskResultStatus
    from django_tasks.exceptions import InvalidTaskError

    from tests.integration.contrib import django_framework_tasks as jobs

    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    with transaction.atomic():
        result = jobs.add.using(queue_name="reports", priority=7, run_after=later).enqueue(1, 2)
    with psycopg.connect(django_dsn) as conn:
        row = conn.execute(
            "SELECT queue, priority, available_at FROM outboxkit_tasks WHERE id = %s",
            (int(result.id),),
        ).fetchone()
    assert row == ("reports", 7, later)
    assert jobs.add.get_result(result.id).status == TaskResultStatus.READY  # scheduled
    with pytest.raises(InvalidTaskError, match="not JSON"):
        jobs.add.enqueue(object(), 1)


def test_a_project_on_djangos_psycopg2_backend_enqueues_in_its_transaction_and_runs_them(
    django_dsn: str, django_configured: None, tmp_path: Path
) -> None:
    """DATABASES on psycopg2 (Django 5.2 takes either driver): the rolled-back enqueue never
    runs, the committed one and the autocommit and ``aenqueue`` ones do, run by
    ``manage.py outboxkit_worker`` on psycopg2 (its task writes through Django's ORM there)
    and read back by ``get_result`` on psycopg2."""
    import json

    from django.contrib.auth.models import Group

    from tests.integration.contrib import django_framework_tasks as jobs

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django_settings",
           "OUTBOXKIT_TEST_DJANGO_DSN": django_dsn}  # fmt: skip

    def scenario(*args: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "tests.integration.contrib.django_psycopg2_tasks", *args],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        seen: dict[str, Any] = json.loads(done.stdout)
        assert seen.pop("driver").startswith("psycopg2")
        return seen

    ids = scenario("enqueue")
    backend = jobs.add.get_backend()
    running = [backend.get_result(ids[k]) for k in ("committed", "autocommit", "async")]
    _run_worker(
        django_dsn, tmp_path, running, manage="tests.integration.contrib.django_psycopg2_manage"
    )
    seen = scenario("results", *ids.values())
    group = Group.objects.get(name="committed")
    assert seen == {
        ids["rolled_back"]: "TaskResultDoesNotExist",
        ids["committed"]: ["SUCCESSFUL", {"id": group.id, "driver": "psycopg2.extensions"}],
        ids["autocommit"]: ["SUCCESSFUL", 5],
        ids["async"]: ["SUCCESSFUL", 42],
    }
    assert not Group.objects.filter(name="rolled back").exists()
