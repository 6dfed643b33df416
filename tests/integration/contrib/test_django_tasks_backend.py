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


def _run_worker(django_dsn: str, tmp_path: Path, results: list[Any]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django_settings",
        "OUTBOXKIT_TEST_DJANGO_DSN": django_dsn,
        "OUTBOXKIT_TEST_SIGNALS_LOG": str(tmp_path / "signals.log"),
    }
    log = tmp_path / "worker.log"
    argv = [sys.executable, "-m", "django", "outboxkit_worker", "--retention", "keep",
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
