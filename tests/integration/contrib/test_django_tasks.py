"""Task mode in Django: ``tasks.enqueue`` inside ``transaction.atomic()`` (with its COMMIT on
psycopg 3), refused outside, and ``manage.py outboxkit_worker`` running a task end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit import Event
from outboxkit.errors import NotInTransactionError
from outboxkit.tasks import InvalidTaskError
from tests.support.relaying import count


@pytest.fixture(autouse=True)
def _handlers(django_configured: None) -> None:
    import tests.integration.contrib.django_jobs  # noqa: F401 (registers the handlers)


def _tasks(dsn: str) -> list[tuple[str, Any, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT task_name, payload, status FROM outboxkit_tasks ORDER BY id")
        return [(r[0], r[1], r[2]) for r in rows]


def test_enqueue_commits_with_the_atomic_block_and_is_not_there_before(django_dsn: str) -> None:
    from django.contrib.auth.models import Group
    from django.db import transaction

    from outboxkit.contrib.django import outbox, tasks

    with transaction.atomic():
        Group.objects.create(name="reports")
        assert tasks.enqueue("report.write", {"file": "/nonexistent", "text": "a"}) is None
        outbox.put(Event(topic="reports", event_type="report.asked", payload={}))
        assert _tasks(django_dsn) == []  # sent with the COMMIT, not before
    assert _tasks(django_dsn) == [("report.write", {"file": "/nonexistent", "text": "a"}, 0)]
    assert count(django_dsn) == 1  # the event of the same block too


def test_a_rolled_back_block_or_savepoint_leaves_no_task(django_dsn: str) -> None:
    from django.contrib.auth.models import Group
    from django.db import transaction

    from outboxkit.contrib.django import tasks

    with pytest.raises(RuntimeError), transaction.atomic():
        Group.objects.create(name="reports")
        tasks.enqueue("report.write", {"file": "x", "text": "rolled back"})
        raise RuntimeError("the view failed")
    with transaction.atomic():
        tasks.enqueue("report.write", {"file": "x", "text": "kept"})
        with pytest.raises(RuntimeError), transaction.atomic():
            tasks.enqueue("report.write", {"file": "x", "text": "savepoint"})
            raise RuntimeError("the inner block failed")
    assert [p["text"] for _n, p, _s in _tasks(django_dsn)] == ["kept"]
    assert not Group.objects.exists()


def test_enqueue_without_commit_hook_on_another_database_says_if_unique_key_was_free(
    django_dsn: str,
) -> None:
    from django.db import transaction
    from django.test import override_settings

    from outboxkit.contrib.django import tasks

    with override_settings(OUTBOXKIT={"WRITE_WITH_COMMIT": False}), transaction.atomic("other"):
        first = tasks.enqueue("report.write", {"file": "x", "text": "1"}, using="other",
                              unique_key="r1")  # fmt: skip
        assert isinstance(first, int) and first > 0
        assert tasks.enqueue("report.write", {"file": "x", "text": "2"}, using="other",
                             unique_key="r1") is None  # fmt: skip
    assert [p["text"] for _n, p, _s in _tasks(django_dsn)] == ["1"]


def test_enqueue_is_refused_outside_atomic_and_checked_before_commit(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import tasks

    with pytest.raises(NotInTransactionError, match="transaction.atomic"):
        tasks.enqueue("report.write", {"file": "x", "text": "autocommit"})
    with pytest.raises(NotInTransactionError, match="using='other'"):
        tasks.enqueue("report.write", {"file": "x", "text": "autocommit"}, using="other")
    with transaction.atomic():
        with pytest.raises(InvalidTaskError, match="no handler"):
            tasks.enqueue("report.unknown", {})
        with pytest.raises(TypeError, match="unexpected option"):
            tasks.enqueue("report.write", {}, dealy=3)
    assert _tasks(django_dsn) == []


def test_the_worker_command_runs_an_enqueued_task(django_dsn: str, tmp_path: Path) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import tasks

    out = tmp_path / "report.txt"
    with transaction.atomic():
        tasks.enqueue("report.write", {"file": str(out), "text": "from django"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django_settings",
        "OUTBOXKIT_TEST_DJANGO_DSN": django_dsn,
    }
    log = tmp_path / "worker.log"
    argv = [sys.executable, "-m", "django", "outboxkit_worker", "--app",
            "tests.integration.contrib.django_jobs:tasks", "--retention", "keep",
            "--poll-interval", "0.2"]  # fmt: skip
    with log.open("wb") as stdout:
        worker = subprocess.Popen(argv, env=env, stdout=stdout, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            if _tasks(django_dsn)[0][2] == 2 or worker.poll() is not None:
                break
            time.sleep(0.1)
        assert _tasks(django_dsn)[0][2] == 2, log.read_text()  # done
        assert out.read_text() == "from django"
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
    assert code == 0, log.read_text()


def test_the_worker_command_lists_the_worker_options_and_refuses_a_bad_app(
    django_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from django.core.management import call_command
    from django.core.management.base import CommandError

    call_command("outboxkit_worker", "--help")
    shown = capsys.readouterr().out
    assert "manage.py outboxkit_worker" in shown and "--concurrency" in shown
    with pytest.raises(CommandError, match="not outboxkit.contrib.django.tasks"):
        call_command("outboxkit_worker", "--app", "tests.integration.contrib.django_jobs:Path")
    with pytest.raises(CommandError, match="--database"):
        call_command("outboxkit_worker", "--dsn", "postgresql://elsewhere/db")


def test_a_view_under_atomic_requests_enqueues_with_its_commit_or_not_at_all(
    django_dsn: str,
) -> None:
    from django.test import Client

    client = Client(raise_request_exception=False)
    assert client.get("/reports/", {"text": "ok"}).status_code == 200
    assert client.get("/reports/", {"text": "failed", "fail": "1"}).status_code == 500
    assert [p["text"] for _n, p, _s in _tasks(django_dsn)] == ["ok"]


def test_the_worker_command_finds_the_handlers_with_or_without_app(django_dsn: str) -> None:
    from outboxkit.contrib.django import tasks
    from outboxkit.contrib.django.management.commands.outboxkit_worker import _load

    assert _load(None) is tasks.tasks  # each installed app's tasks module imported
    assert _load("tests.integration.contrib.django_jobs:tasks") is tasks.tasks
    assert "report.write" in tasks.tasks.types


def test_a_view_enqueues_a_task_whose_handler_lives_in_the_apps_tasks_module(
    db_dsn: str,
) -> None:
    """docs/django.md's layout: handlers in `orders/tasks.py`, a view enqueuing. The web
    process never imported the apps' tasks modules (only `outboxkit_worker` did), so the
    view answered 500 (`no handler is registered for task 'receipt.send'`); the app's
    ready() imports them now."""
    from outboxkit.backends.postgres.migrate import migrate_tasks

    migrate_tasks(db_dsn)
    root = Path(__file__).resolve().parents[3]
    code = (
        "import django; django.setup()\n"
        "from django.test import Client\n"
        "response = Client().post('/orders/')\n"
        "print('status', response.status_code)\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.support.django_receipts.settings",
        "OUTBOXKIT_TEST_DJANGO_DSN": db_dsn,
        "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)]),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert "status 200" in done.stdout, done.stdout + done.stderr
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute("SELECT task_name, payload FROM outboxkit_tasks").fetchone()
    assert row == ("receipt.send", {"order": 7})
