"""A per-key limit across worker processes on MariaDB: `outboxkit worker --dsn mysql://…` x 3,
one SIGKILLed mid-run, never more than ``concurrency_per_key`` of a key running at once (the
claim and the promotions in the database), where a limit kept in each process runs three
times it (PostgreSQL's: test_tasks_limits.py)."""

from __future__ import annotations

import datetime as dt
import subprocess
from typing import Any

import psutil
import pymysql
import pytest

from outboxkit.backends.mariadb.sql import connect_args
from tests.integration.test_mariadb_tasks_end_to_end import (
    kill,
    spawn_worker,
    stop,
    tasks_url,
    wait_for,
)
from tests.integration.test_tasks_limits import assert_key_limit_kept, max_overlap
from tests.support.mariadb_ops import mariadb_execute
from tests.support.mariadb_tasks_app import tasks

PER_KEY = 2  # tests/support/mariadb_tasks_app.py: @tasks.handler("per_key", concurrency_per_key=2)
KEYED_TASKS = 18  # of three keys
SECONDS = 0.5  # each (long enough to overlap on a loaded machine)
__all__ = ["tasks_url"]  # (the fixture)
# Three worker processes judged by their handlers' clocks: a starved worker's lease lapses
# (a zombie by design) and skews the count, so these run with no test beside them.
pytestmark = pytest.mark.exclusive


def _count(url: str, query: str) -> int:
    rows = mariadb_execute(url, query)
    return int(rows[0][0]) if rows and rows[0][0] is not None else 0


def _enqueue_keyed(url: str, name: str, keyed: bool) -> None:
    conn = pymysql.connect(**connect_args(url))
    try:
        conn.begin()
        for i in range(KEYED_TASKS):
            key = f"tenant-{i % 3}"
            if keyed:
                tasks.enqueue(conn, name, {"seconds": SECONDS}, key=key)
            else:
                tasks.enqueue(conn, name, {"seconds": SECONDS, "key": key})
        conn.commit()
    finally:
        conn.close()


def _seconds(at: dt.datetime) -> float:
    return at.replace(tzinfo=dt.UTC).timestamp()


def _keyed_runs(
    url: str, killed_pid: int | None, killed_at: float
) -> dict[str, list[tuple[float, float]]]:
    """Each key's runs as (start, end) by the database's clock; a run of the SIGKILLed worker
    that never ended ran until the kill."""
    rows = mariadb_execute(url, "SELECT `key`, pid, started, ended FROM keyed_runs")
    per_key: dict[str, list[tuple[float, float]]] = {}
    for key, pid, start, end in rows:
        if end is None and killed_pid is None:
            continue  # (a naive run the stop cut short: its overlap is not the question)
        if end is None:
            assert pid == killed_pid, (key, pid, start)
        finish = killed_at if end is None else _seconds(end)
        per_key.setdefault(key, []).append((_seconds(start), finish))
    return per_key


def _connected(worker: subprocess.Popen[bytes], port: int) -> bool:
    try:
        found = psutil.Process(worker.pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    return any(c.raddr and c.raddr.port == port for c in found)


def claiming(url: str, *args: str) -> list[subprocess.Popen[bytes]]:
    """Three `outboxkit worker` processes, each once it has a connection to the server
    (tasks enqueued then are there for all three, not for the first one up)."""
    options = ("--prefetch", "0", *args)
    workers = [spawn_worker(url, *options) for _ in range(3)]
    port = int(connect_args(url)["port"])
    try:
        wait_for(lambda: all(_connected(w, port) for w in workers), timeout=30)
    except BaseException:
        for worker in workers:
            stop(worker)
        raise
    return workers


def _drained(url: str) -> bool:
    return _count(url, "SELECT COUNT(*) FROM outboxkit_tasks") == 0


def test_a_worker_local_per_key_limit_runs_three_times_it_across_three_workers(
    tasks_url: str,
) -> None:
    """The naive way: a semaphore of 2 per key in each worker process."""
    workers = claiming(tasks_url, "--concurrency", "6")
    try:
        _enqueue_keyed(tasks_url, "naive_per_key", keyed=False)
        wait_for(lambda: _drained(tasks_url), timeout=30)
    finally:
        for worker in workers:
            stop(worker)
    overlaps = [max_overlap(r) for r in _keyed_runs(tasks_url, None, 0.0).values()]
    assert max(overlaps) > PER_KEY, overlaps


def test_three_workers_never_run_more_than_the_per_key_limit_of_a_key_through_a_kill(
    tasks_url: str,
) -> None:
    workers = claiming(tasks_url, "--concurrency", "20", "--lease", "2")
    killed: Any = None
    try:
        _enqueue_keyed(tasks_url, "per_key", keyed=True)
        wait_for(lambda: _count(tasks_url, "SELECT COUNT(*) FROM keyed_runs") >= 6, timeout=30)
        # the worker that started a task last: its places free when its leases lapse
        last = _count(tasks_url, "SELECT pid FROM keyed_runs ORDER BY started DESC LIMIT 1")
        killed = next(w for w in workers if w.pid == last)
        kill(killed)
        killed_at = _seconds(mariadb_execute(tasks_url, "SELECT UTC_TIMESTAMP(6)")[0][0])
        wait_for(lambda: _drained(tasks_url), timeout=60)
    finally:
        for worker in workers:
            stop(worker)
    runs = _keyed_runs(tasks_url, killed.pid, killed_at)
    ran = _count(tasks_url, "SELECT COUNT(DISTINCT task_id) FROM keyed_runs")
    assert_key_limit_kept(runs, ran, KEYED_TASKS, PER_KEY)
