"""A process killed between the COMMIT and an ``on_commit`` callback, with django-tasks-db's
backend and with outboxkit's, in one Django project on one database
(tests/support/django_tasks_pair): the on_commit enqueue is lost, the order it was for
committed without it; outboxkit's enqueue was a row of the order's transaction and runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit.testing import create_database, drop_database
from tests.support.servers import unique_name

pytest.importorskip("django_tasks_db")

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = {  # the task row of each backend, and whether it finished (its return value)
    "outboxkit": "SELECT payload->'args'->>0, status = 2, result FROM outboxkit_tasks",
    "tasks-db": "SELECT args_kwargs->'args'->>0, status = 'SUCCESSFUL', return_value"
    " FROM django_tasks_database_dbtaskresult",
}


def _env(dsn: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    return env | {
        "DJANGO_SETTINGS_MODULE": "tests.support.django_tasks_pair.settings",
        "OUTBOXKIT_TEST_DJANGO_DSN": dsn,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }


@pytest.fixture
def pair_dsn(pg_server: Any) -> Iterator[str]:
    """A database ``manage.py migrate`` made for the pair (both backends' tables)."""
    name = unique_name("django_pair")
    create_database(pg_server.dsn, name)
    dsn = pg_server.dsn_for(name)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "django", "migrate", "-v0"], env=_env(dsn), cwd=ROOT,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        yield dsn
    finally:
        drop_database(pg_server.dsn, name)


def _place_order_and_die(dsn: str, mode: str) -> int:
    """The order's view in a process SIGKILLed after its COMMIT; the order's id."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.django_tasks_pair.place_order", mode, "o1"],
        env=_env(dsn), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line == "committed\n", line + (child.stderr.read() if child.stderr else "")
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT id FROM auth_group WHERE name = 'o1'").fetchone()
    assert row is not None  # the order committed
    return int(row[0])


def _work(dsn: str, backend: str) -> list[tuple[Any, ...]]:
    """Run the backend's own worker over what is there; the task rows afterwards."""
    if backend == "tasks-db":  # --batch: run what is ready, then exit
        argv = ["db_worker", "--backend", "db", "--batch", "--no-startup-delay"]
        done = subprocess.run(
            [sys.executable, "-m", "django", *argv], env=_env(dsn), cwd=ROOT,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    else:
        worker = subprocess.Popen(
            [sys.executable, "-m", "django", "outboxkit_worker", "--poll-interval", "0.1"],
            env=_env(dsn), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and worker.poll() is None:
                with psycopg.connect(dsn) as conn:
                    pending = conn.execute(
                        "SELECT count(*) FROM outboxkit_tasks WHERE status <> 2"
                    ).fetchone()
                if pending == (0,):
                    break
                time.sleep(0.1)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=30)
    with psycopg.connect(dsn) as conn:
        return conn.execute(SHIPPED[backend]).fetchall()


def test_a_kill_after_the_commit_loses_the_on_commit_enqueue_not_outboxkits(
    pair_dsn: str,
) -> None:
    order = _place_order_and_die(pair_dsn, "tasks-db-on-commit")
    assert _work(pair_dsn, "tasks-db") == []  # the order committed, its task never existed
    with psycopg.connect(pair_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM auth_group")
    order = _place_order_and_die(pair_dsn, "outboxkit")
    assert _work(pair_dsn, "outboxkit") == [(str(order), True, order)]  # written with it; ran


def test_django_tasks_dbs_enqueue_inside_the_block_survives_the_kill_too(
    pair_dsn: str,
) -> None:
    """The loss is the on_commit pattern's: django-tasks-db's enqueue called inside the
    block, on the database of the block, is a row of its transaction as well."""
    order = _place_order_and_die(pair_dsn, "tasks-db")
    assert _work(pair_dsn, "tasks-db") == [(str(order), True, order)]
