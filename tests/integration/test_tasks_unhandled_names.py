"""Task names a worker has no handler for (a rolling deploy with mixed versions).

Before: a worker without `email.welcome`'s handler claimed those tasks and dead-lettered
them at once (45 live tasks failed in seconds), one ERROR line each (100 000 unknown tasks
wrote 24 MB of log and delayed known ones by 176 s). Now a worker claims only the names it
has handlers for; the others wait for a worker that has them, and fail only when none
claimed them for `unhandled_grace` (an hour by default).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.tasks import Tasks, Worker
from tests.support.tasks_app import RUNS_DDL
from tests.support.tasks_app import tasks as old_version

ROOT = Path(__file__).resolve().parents[2]

new_version = Tasks()
welcomed: list[int] = []


@new_version.handler("email.welcome")
def welcome(payload: dict[str, int]) -> None:
    welcomed.append(payload["user"])


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(RUNS_DDL)
    yield db_dsn


def _rows(dsn: str) -> list[tuple[str, int, int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT task_name, status, attempts FROM outboxkit_tasks ORDER BY id"
        ).fetchall()


def _runs(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM task_runs").fetchone()
    return int(row[0]) if row else 0


def test_a_rolling_deploy_leaves_new_names_to_the_workers_that_have_them(
    tasks_dsn: str,
) -> None:
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for user in range(45):
            new_version.enqueue(conn, "email.welcome", {"user": user})
        for _ in range(5):
            old_version.enqueue(conn, "quick")
    env = {**os.environ, "OUTBOXKIT_DSN": tasks_dsn,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}  # fmt: skip
    old = subprocess.Popen(
        [sys.executable, "-m", "outboxkit", "worker", "--app", "tests.support.tasks_app:tasks",
         "--poll-interval", "0.1", "--dsn", tasks_dsn],
        env=env, cwd=ROOT, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while _runs(tasks_dsn) < 5:
            assert time.monotonic() < deadline, "the old worker ran its own tasks"
            time.sleep(0.05)
        time.sleep(1.0)  # polls and claims go on; the new name stays untouched
        assert _rows(tasks_dsn) == [("email.welcome", 0, 0)] * 45  # pending, no attempt
        old.send_signal(signal.SIGTERM)
        _out, err = old.communicate(timeout=15)
    finally:
        if old.poll() is None:
            old.kill()
    assert "email.welcome" not in err.decode(), "no line per task it does not run"

    async def new_worker() -> None:
        worker = Worker(new_version, tasks_dsn, poll_interval=0.05)
        run = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 20
        while len(welcomed) < 45 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        worker.stop()
        await run

    asyncio.run(new_worker())
    assert sorted(welcomed) == list(range(45)) and _rows(tasks_dsn) == []


async def test_a_name_no_worker_claims_within_the_grace_is_failed_with_the_reason(
    tasks_dsn: str,
) -> None:
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        new_version.enqueue(conn, "email.welcome", {"user": 1})
        new_version.enqueue(conn, "email.welcome", {"user": 2}, delay=3600)  # not due
    worker = Worker(old_version, tasks_dsn, poll_interval=0.05, unhandled_grace=0.5)
    run = asyncio.create_task(worker.run())
    try:
        deadline = time.monotonic() + 15
        while _rows(tasks_dsn)[0][1] != 3:
            assert time.monotonic() < deadline, "never failed"
            await asyncio.sleep(0.05)
    finally:
        worker.stop()
        await run
    with psycopg.connect(tasks_dsn) as conn:
        rows = conn.execute(
            "SELECT status, error_type, last_error FROM outboxkit_tasks ORDER BY id"
        ).fetchall()
    assert rows[0][:2] == (3, "UnknownTask")
    assert "no worker with a handler for task email.welcome claimed it" in rows[0][2]
    assert rows[1][0] == 0  # the delayed one waits


async def test_a_flood_of_unknown_names_does_not_hold_back_known_tasks(
    tasks_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 000 due tasks of a name this worker lacks, ahead of one it has: it starts within
    a second (the claim passes over them; it used to claim and fail each, 176 s for 100 000)."""
    monkeypatch.setenv("OUTBOXKIT_DSN", tasks_dsn)  # (the handler records its run there)
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outboxkit_tasks (task_name, queue, payload, available_at)"
            " SELECT 'email.welcome', 'default', '{\"user\": 0}', now() - interval '1 s'"
            " FROM generate_series(1, 20000)"
        )
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        old_version.enqueue(conn, "quick")
    worker = Worker(old_version, tasks_dsn, poll_interval=0.05)
    started = time.monotonic()
    run = asyncio.create_task(worker.run())
    try:
        while _runs(tasks_dsn) < 1:
            assert time.monotonic() - started < 10, "the known task did not start"
            await asyncio.sleep(0.02)
        took = time.monotonic() - started
    finally:
        worker.stop()
        await run
    assert took < 3.0, took
    with psycopg.connect(tasks_dsn) as conn:
        pending = conn.execute("SELECT count(*) FROM outboxkit_tasks WHERE status = 0").fetchone()
    assert pending == (20000,)
