"""outboxkit's backend on Django 6's own ``django.tasks`` (no backport), run by
tests/integration/contrib/test_django6_tasks.py in build/django6-venv under Python 3.13:
the interface (``BaseTaskBackend``, the ``supports_*`` flags, ``TaskResult`` and its
statuses, ``get_result``, ``InvalidTask``, ``TaskResultDoesNotExist``), the three signals,
and ``manage.py outboxkit_worker`` running what a committed ``atomic()`` block enqueued."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.django_worker import run_until_finished

pytest.importorskip(
    "django.tasks", reason="Django 6's django.tasks: run in a 3.13 venv by test_django6_tasks.py"
)

ROOT = Path(__file__).resolve().parents[4]


def _worker(dsn: str, signals_log: Path, results: list[Any], tmp_path: Path) -> str:
    """``manage.py outboxkit_worker`` until every result is finished; its log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django6.settings",
        "OUTBOXKIT_TEST_DJANGO_DSN": dsn,
        "OUTBOXKIT_TEST_SIGNALS_LOG": str(signals_log),
        "PYTHONPATH": str(ROOT),
    }
    log = tmp_path / "worker.log"
    argv = [sys.executable, "-m", "django", "outboxkit_worker", "--retention", "keep",
            "--poll-interval", "0.2"]  # fmt: skip
    code = run_until_finished(argv, results, log, env=env, cwd=ROOT)
    assert all(r.is_finished for r in results), log.read_text()
    assert code == 0, log.read_text()
    return log.read_text()


def test_the_backend_is_a_django_tasks_backend_with_its_flags(django6: str) -> None:
    import django
    from django.tasks import default_task_backend, task_backends
    from django.tasks.backends.base import BaseTaskBackend

    from outboxkit.contrib.django.tasks_backend import OutboxkitBackend

    assert django.VERSION >= (6, 0)
    assert "django_tasks" not in sys.modules  # Django's own framework, not the backport
    backend = task_backends["default"]
    assert isinstance(backend, OutboxkitBackend) and isinstance(backend, BaseTaskBackend)
    assert default_task_backend.alias == "default"
    assert (backend.supports_defer, backend.supports_async_task) == (True, True)
    assert (backend.supports_get_result, backend.supports_priority) == (True, True)
    assert backend.check() == []


def test_a_rolled_back_enqueue_never_runs_a_committed_one_runs_with_signals_and_results(
    django6: str, tmp_path: Path
) -> None:
    from django.db import transaction
    from django.tasks import TaskResultStatus
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued

    from tests.integration.contrib import django_framework_tasks as jobs

    enqueued: list[Any] = []

    def on_enqueued(sender: Any, task_result: Any, **kwargs: Any) -> None:
        enqueued.append(task_result)

    task_enqueued.connect(on_enqueued)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            lost = jobs.add.enqueue(1, 1)
            raise RuntimeError("the view failed")
        with transaction.atomic():
            added = jobs.add.enqueue(2, 3)
            with psycopg.connect(django6) as other:  # not visible before the COMMIT
                assert other.execute("SELECT count(*) FROM outboxkit_tasks").fetchone() == (0,)
        outside = jobs.add_async.enqueue(4, 5)  # autocommit: at once
        ctx = jobs.attempt.enqueue()
        failed = jobs.fail.enqueue()
    finally:
        task_enqueued.disconnect(on_enqueued)
    assert [r.id for r in enqueued] == [lost.id, added.id, outside.id, ctx.id, failed.id]
    assert added.status == TaskResultStatus.READY and added.enqueued_at is not None
    with pytest.raises(TaskResultDoesNotExist):
        jobs.add.get_result(lost.id)
    signals_log = tmp_path / "signals.log"
    _worker(django6, signals_log, [added, outside, ctx, failed], tmp_path)
    assert added.status == TaskResultStatus.SUCCESSFUL and added.return_value == 5
    assert added.attempts == 1 and added.finished_at >= added.started_at
    assert outside.return_value == 9
    assert ctx.return_value == 1
    assert failed.status == TaskResultStatus.FAILED
    with pytest.raises(ValueError, match="Task failed"):
        failed.return_value  # noqa: B018 (the framework's property raises)
    assert failed.errors[-1].exception_class is jobs.ReportFailed
    assert "the report failed" in failed.errors[-1].traceback
    seen = signals_log.read_text().splitlines()
    for r, outcome in ((added, "SUCCESSFUL"), (outside, "SUCCESSFUL"), (failed, "FAILED")):
        assert f"started {r.id} RUNNING" in seen and f"finished {r.id} {outcome}" in seen
    assert not any(lost.id in line.split() for line in seen)
    fresh = jobs.add.get_result(added.id)  # by id, as another process would
    assert (fresh.status, fresh.return_value, fresh.args) == (
        TaskResultStatus.SUCCESSFUL,
        5,
        [2, 3],
    )


def test_aenqueue_and_aget_result_from_async_code(django6: str, tmp_path: Path) -> None:
    from django.tasks import TaskResultStatus

    from tests.integration.contrib import django_framework_tasks as jobs

    async def enqueue() -> Any:
        result = await jobs.add.aenqueue(20, 22)
        again = await jobs.add.aget_result(result.id)
        assert again.status == TaskResultStatus.READY
        return result

    result = asyncio.run(enqueue())
    _worker(django6, tmp_path / "signals.log", [result], tmp_path)
    assert result.return_value == 42


def test_get_result_gives_back_the_queue_priority_and_run_after_and_refuses_bad_tasks(
    django6: str,
) -> None:
    import datetime as dt

    from django.tasks import TaskResultStatus
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist

    from tests.integration.contrib import django_framework_tasks as jobs

    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    scheduled = jobs.add.using(queue_name="reports", priority=7, run_after=later).enqueue(1, 2)
    found = jobs.add.get_result(scheduled.id)
    assert found.status == TaskResultStatus.READY  # not before run_after
    assert (found.task.queue_name, found.task.priority, found.task.run_after) == (
        "reports", 7, later,
    )  # fmt: skip
    assert found.task.func is jobs.add.func
    with pytest.raises(InvalidTask, match="not JSON"):
        jobs.add.enqueue(object(), 1)
    with pytest.raises(InvalidTask, match="Queue 'nightly' is not valid"):
        jobs.add.using(queue_name="nightly")
    for unknown in ("999999", "not-an-id"):
        with pytest.raises(TaskResultDoesNotExist):
            jobs.add.get_result(unknown)
