"""Task mode end to end on the private mariadbd: tasks enqueued from PyMySQL in committed and
rolled-back transactions, `outboxkit worker --dsn mysql://…` SIGKILLed mid-run and started
again. Every committed task's effect lands exactly once (written in the handler's fenced
transaction), and no rolled-back task ever runs; a naive handler, whose effect commits
apart from the completion, applies its effect twice under the same kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.testing import free_port
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import mariadb_execute, new_database
from tests.support.mariadb_tasks_app import DDL, tasks

ROOT = Path(__file__).resolve().parents[2]
LEASE = "1.5"


@pytest.fixture
def tasks_url(mariadb_server: MariaDB) -> Iterator[str]:
    url = new_database(mariadb_server)
    migrate(url, kind="tasks", table="outboxkit_tasks")
    for statement in DDL:
        mariadb_execute(url, statement)
    yield url


def spawn_worker(url: str, *args: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OUTBOXKIT_DSN": url,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    command = [sys.executable, "-m", "outboxkit", "worker", "--dsn", url, "--app",
               "tests.support.mariadb_tasks_app:tasks", "--poll-interval", "0.1",
               "--lease", LEASE, *args]  # fmt: skip
    return subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE)


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def enqueue(url: str, name: str, payloads: list[dict[str, Any]], *, commit: bool) -> None:
    """One PyMySQL transaction enqueuing ``payloads``, committed or rolled back."""
    conn = pymysql.connect(**connect_args(url))
    try:
        conn.begin()
        for payload in payloads:
            tasks.enqueue(conn, name, payload)
        conn.commit() if commit else conn.rollback()
    finally:
        conn.close()


def effects(url: str) -> list[int]:
    return sorted(r[0] for r in mariadb_execute(url, "SELECT n FROM effects"))


def kill(worker: subprocess.Popen[bytes]) -> None:
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)


def stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()


def test_a_naive_handler_applies_its_effect_twice_when_its_worker_is_killed(
    tasks_url: str,
) -> None:
    """The adversary: the effect committed, the worker died before the completion, the task
    ran again after its lease and applied the effect a second time."""
    enqueue(tasks_url, "naive_effect", [{"n": 1, "hold": 30}], commit=True)
    first = spawn_worker(tasks_url)
    try:
        wait_for(lambda: effects(tasks_url) == [1])
        kill(first)
        second = spawn_worker(tasks_url)
        try:
            wait_for(lambda: not mariadb_execute(tasks_url, "SELECT id FROM outboxkit_tasks"))
        finally:
            stop(second)
    finally:
        stop(first)
    assert effects(tasks_url) == [1, 1]


def test_every_committed_task_lands_once_and_no_rolled_back_one_runs_across_a_sigkill(
    tasks_url: str,
) -> None:
    held = [{"n": n, "hold": 30} for n in range(4)]  # first attempts hang: killed mid-run
    quick = [{"n": n} for n in range(4, 40)]
    enqueue(tasks_url, "effect", held, commit=True)
    enqueue(tasks_url, "effect", [{"n": 1000 + n} for n in range(10)], commit=False)
    enqueue(tasks_url, "effect", quick[:18], commit=True)
    enqueue(tasks_url, "effect", [{"n": 2000 + n} for n in range(10)], commit=False)
    first = spawn_worker(tasks_url, "--concurrency", "8")
    try:
        # every held task is inside its transaction, its effect written and not committed
        wait_for(lambda: len(mariadb_execute(tasks_url, "SELECT 1 FROM task_runs")) >= 4 + 18)
        wait_for(
            lambda: (
                {r[0] for r in mariadb_execute(tasks_url, "SELECT task_id FROM task_runs")}
                >= {r[0] for r in mariadb_execute(tasks_url, "SELECT id FROM outboxkit_tasks")}
            )
        )
        enqueue(tasks_url, "effect", quick[18:], commit=True)  # while it runs
        kill(first)
        second = spawn_worker(tasks_url, "--concurrency", "8")
        try:
            wait_for(lambda: not mariadb_execute(tasks_url, "SELECT id FROM outboxkit_tasks"))
        finally:
            stop(second)
    finally:
        stop(first)
    assert effects(tasks_url) == list(range(40))  # each committed task's effect, once
    runs = mariadb_execute(tasks_url, "SELECT task_id, attempt FROM task_runs")
    # (an attempt past the 2nd is a lease lost on a loaded machine: its transaction, effect
    # and all, was rolled back by the fenced completion, and the effects above are still once)
    assert max(attempt for _id, attempt in runs) >= 2  # the killed runs ran again
    assert len({task_id for task_id, _attempt in runs}) == 40  # no rolled-back task ran


def test_a_zombie_attempts_effect_is_rolled_back_with_its_fenced_completion(
    tasks_url: str,
) -> None:
    """A worker frozen (SIGSTOP) inside the handler's transaction past its lease: another
    worker runs the task again and completes it; thawed, the zombie's completion matches no
    row, so its transaction (its effect with it) rolls back."""
    enqueue(tasks_url, "effect", [{"n": 7, "hold": 3}], commit=True)
    zombie = spawn_worker(tasks_url)
    try:
        wait_for(lambda: len(mariadb_execute(tasks_url, "SELECT 1 FROM task_runs")) == 1)
        zombie.send_signal(signal.SIGSTOP)
        other = spawn_worker(tasks_url)
        try:
            wait_for(lambda: effects(tasks_url) == [7])  # attempt 2, after the lease
            zombie.send_signal(signal.SIGCONT)
            time.sleep(4)  # the zombie's hold ends, its completion fails, it rolls back
        finally:
            stop(other)
    finally:
        zombie.send_signal(signal.SIGCONT)
        stop(zombie)
    assert effects(tasks_url) == [7]
    attempts = sorted(r[0] for r in mariadb_execute(tasks_url, "SELECT attempt FROM task_runs"))
    assert attempts == [1, 2]
    assert not mariadb_execute(tasks_url, "SELECT id FROM outboxkit_tasks")


def test_the_worker_process_serves_task_metrics_read_from_the_mariadb_table(
    tasks_url: str,
) -> None:
    """`outboxkit worker --dsn mysql://… --metrics-port N` scraped over HTTP: the outcome and
    run-time series of the tasks it ran, and the gauges it reads from the task table at each
    scrape (scheduled, queued, a paused queue), as PostgreSQL's worker serves them."""
    port = free_port()
    enqueue(tasks_url, "effect", [{"n": 1}, {"n": 2}], commit=True)
    conn = pymysql.connect(**connect_args(tasks_url))
    try:
        conn.begin()
        tasks.enqueue(conn, "effect", {"n": 3}, delay=3600)
        tasks.enqueue(conn, "effect", {"n": 4}, queue="reports")
        conn.commit()
    finally:
        conn.close()
    assert tasks.pause(tasks_url, "reports")
    worker = spawn_worker(tasks_url, "--metrics-port", str(port), "--metrics-host", "127.0.0.1")

    def scrape(path: str = "/metrics") -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    try:
        wait_for(
            lambda: 'outboxkit_tasks_finished_total{outcome="done",task="effect"} 2.0' in scrape()
        )
        body = scrape()
        assert 'outboxkit_task_run_seconds_count{task="effect"} 2.0' in body
        assert 'outboxkit_tasks_scheduled{task="effect"} 1.0' in body
        assert 'outboxkit_tasks_queued{task="effect"} 1.0' in body  # the paused queue's
        assert 'outboxkit_tasks_failed{task="effect"} 0.0' in body
        assert 'outboxkit_task_queue_paused{queue="reports"} 1.0' in body
        assert scrape("/healthz") != "" and scrape("/readyz") != ""
    finally:
        stop(worker)
    assert worker.returncode == 0
    assert effects(tasks_url) == [1, 2]
