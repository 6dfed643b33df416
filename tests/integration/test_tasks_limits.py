"""Concurrency limits across worker processes: `outboxkit worker` x 3, one SIGKILLed and one
SIGSTOPped past its lease, never more than the limit running, of a name or of one key
(docs/tasks.md)."""

from __future__ import annotations

import bisect
import signal
import subprocess
import time

import psycopg
import pytest

from tests.integration.test_tasks_processes import (
    spawn_worker,
    stop_workers,
    tasks_dsn,
    wait_for,
)
from tests.support.tasks_app import KEYED_DDL, LIMITED_DDL, tasks

LIMIT = 4  # tests/support/tasks_app.py: @tasks.handler("limited", concurrency=4)
PER_KEY = 2  # @tasks.handler("per_key", concurrency_per_key=2)
KEYED_TASKS = 90  # of three keys, 0.1 s each
KEY_PACED = 40  # tasks of each of three keys: @tasks.handler("key_paced", rate_per_key="10/s")
__all__ = ["tasks_dsn"]  # (the fixture)
# Three worker processes judged by their handlers' clocks: a starved worker's lease lapses
# (a zombie by design) and skews the count, so these run with no test beside them.
pytestmark = pytest.mark.exclusive


def _count(dsn: str, query: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query).fetchone()
    return int(row[0]) if row is not None else 0


def _now(dsn: str) -> float:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    assert row is not None
    return float(row[0])


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same instant)."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = running = 0
    for _at, step in edges:
        running += step
        most = max(most, running)
    return most


def assert_key_limit_kept(
    runs: dict[str, list[tuple[float, float]]], ran: int, tasks: int, per_key: int
) -> None:
    """Every task ran (``ran`` distinct ones), on three keys, never more than ``per_key`` of
    a key at once, and ``per_key`` reached on every key (the limit used, not undershot)."""
    assert ran == tasks
    assert sorted(runs) == ["tenant-0", "tenant-1", "tenant-2"]
    overlaps = [max_overlap(r) for r in runs.values()]
    assert max(overlaps) <= per_key, overlaps
    assert min(overlaps) == per_key, overlaps


def busiest_second(starts: list[float]) -> int:
    """The most starts (sorted) in any one-second window."""
    return max(bisect.bisect_left(starts, s + 1.0) - i for i, s in enumerate(starts))


def claiming(dsn: str, *args: str) -> list[subprocess.Popen[bytes]]:
    """Three `outboxkit worker` processes, each once it has its claim connection (tasks
    enqueued then are there for all three, not for the first one up)."""
    workers = [spawn_worker(dsn, *args) for _ in range(3)]
    ready = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'outboxkit-worker:claim'"
    )
    try:
        wait_for(lambda: _count(dsn, ready) >= 3, timeout=30)
    except BaseException:
        stop_workers(*workers)
        raise
    return workers


def drain(dsn: str, *args: str, timeout: float) -> None:
    """Three `outboxkit worker` processes run until the task table is empty."""
    workers = [spawn_worker(dsn, *args) for _ in range(3)]
    try:
        wait_for(lambda: _count(dsn, "SELECT count(*) FROM outboxkit_tasks") == 0, timeout=timeout)
    finally:
        stop_workers(*workers)


def test_three_workers_never_run_more_than_the_limit_through_a_kill_and_a_freeze(
    tasks_dsn: str,
) -> None:
    limits_dsn = tasks_dsn
    with psycopg.connect(limits_dsn, autocommit=True) as conn:
        conn.execute(LIMITED_DDL)
    with psycopg.connect(limits_dsn) as conn, conn.transaction():
        for _ in range(300):
            tasks.enqueue(conn, "limited", {"seconds": 0.05})
    args = ("--concurrency", "50", "--lease", "2")
    workers = [spawn_worker(limits_dsn, *args) for _ in range(3)]
    killed, frozen, _steady = workers
    started = "SELECT count(*) FROM limited_runs"
    try:
        wait_for(lambda: _count(limits_dsn, started) >= 60, timeout=30)
        killed.send_signal(signal.SIGKILL)  # its slots free when its leases lapse
        killed.wait(10)
        wait_for(lambda: _count(limits_dsn, started) >= 120, timeout=30)
        frozen.send_signal(signal.SIGSTOP)  # no heartbeat: its leases lapse while it sleeps
        stopped_at = _now(limits_dsn)
        time.sleep(3.5)  # past the lease
        frozen.send_signal(signal.SIGCONT)  # its zombie settles are fenced: no slot freed
        wait_for(
            lambda: _count(limits_dsn, "SELECT count(*) FROM outboxkit_tasks") == 0, timeout=60
        )
    finally:
        stop_workers(*workers)
    with psycopg.connect(limits_dsn) as conn:
        rows = conn.execute(
            "SELECT task_id, pid, extract(epoch FROM started)::float8,"
            " extract(epoch FROM ended)::float8 FROM limited_runs"
        ).fetchall()
    assert len({task_id for task_id, *_ in rows}) == 300  # every task ran
    # A SIGKILLed run never ended (its slot held until the lease lapsed: not counted, only
    # fewer). A run frozen by SIGSTOP across its lease is a zombie: its handler resumes and
    # finishes while its slot is another task's (no lease can stop a frozen process
    # waking), so it is left out; every other run held its slot from claim to settle.
    pid = frozen.pid
    zombies = [r for r in rows if r[1] == pid and r[2] < stopped_at and r[3] is not None
               and r[3] > stopped_at + 1]  # fmt: skip
    assert len(zombies) <= LIMIT
    counted = [(s, e) for _id, p, s, e in rows if e is not None and (_id, p, s, e) not in zombies]
    assert len(counted) >= 300 - 2 * LIMIT
    assert max_overlap(counted) <= LIMIT
    assert max_overlap(counted) == LIMIT  # the limit is used, not undershot to 1


def test_three_workers_start_a_rate_limited_name_at_its_rate_plus_the_burst(
    tasks_dsn: str,
) -> None:
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute(LIMITED_DDL)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for _ in range(600):
            tasks.enqueue(conn, "paced")
    drain(tasks_dsn, "--concurrency", "50", timeout=40)
    with psycopg.connect(tasks_dsn) as conn:
        rows = conn.execute(
            "SELECT extract(epoch FROM claimed)::float8, extract(epoch FROM started)::float8,"
            " attempt FROM limited_runs ORDER BY 1"
        ).fetchall()
    claims = [c for c, _, _ in rows]
    starts = sorted(s for _, s, _ in rows)
    assert len(starts) == 600 and {a for *_, a in rows} == {1}  # waiting spent no attempt
    assert len({pid for pid in _pids(tasks_dsn)}) == 3  # every worker started some
    # At most 50 claims in any one-second window, plus the burst (a tenth: 5), by the time
    # each claim spent its token. The handlers' own first statements come a little later,
    # by a delay that varies with the load (a connect, a local queue): a window of them
    # may hold a few more, never three workers' worth (a worker-local bucket: ~150).
    busiest = busiest_second(claims)
    assert busiest <= 55, busiest
    assert busiest_second(starts) <= 70, busiest_second(starts)
    took = starts[-1] - starts[0]
    assert 10.5 <= took <= 14.0, took  # (600 - 5) / 50 = 11.9 s: not 1, not 60


def _pids(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT DISTINCT pid FROM limited_runs")]


def _keyed_runs(
    dsn: str, killed_pid: int | None, killed_at: float
) -> dict[str, list[tuple[float, float]]]:
    """Each key's runs as (start, end) by the database's clock; a run of the SIGKILLed worker
    that never ended ran until the kill."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT key, pid, extract(epoch FROM started)::float8,"
            " extract(epoch FROM ended)::float8 FROM keyed_runs"
        ).fetchall()
    per_key: dict[str, list[tuple[float, float]]] = {}
    for key, pid, start, end in rows:
        if end is None:
            assert pid == killed_pid, (key, pid, start)
            end = killed_at
        per_key.setdefault(key, []).append((start, end))
    return per_key


def _enqueue_keyed(dsn: str, name: str, keyed: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(KEYED_DDL)
    with psycopg.connect(dsn) as conn, conn.transaction():
        for i in range(KEYED_TASKS):
            key = f"tenant-{i % 3}"
            if keyed:
                tasks.enqueue(conn, name, {"seconds": 0.1}, key=key)
            else:
                tasks.enqueue(conn, name, {"seconds": 0.1, "key": key})


def test_a_worker_local_per_key_limit_runs_three_times_it_across_three_workers(
    tasks_dsn: str,
) -> None:
    """The naive way: a semaphore of 2 per key in each worker process."""
    workers = claiming(tasks_dsn, "--concurrency", "6", "--prefetch", "0")
    try:
        _enqueue_keyed(tasks_dsn, "naive_per_key", keyed=False)
        wait_for(lambda: _count(tasks_dsn, "SELECT count(*) FROM outboxkit_tasks") == 0, timeout=30)
    finally:
        stop_workers(*workers)
    overlaps = [max_overlap(r) for r in _keyed_runs(tasks_dsn, None, 0.0).values()]
    assert max(overlaps) > PER_KEY, overlaps  # ([6, 6, 6]: 3 workers x 2, in docs/tasks.md)


def test_three_workers_never_run_more_than_the_per_key_limit_of_a_key_through_a_kill(
    tasks_dsn: str,
) -> None:
    workers = claiming(tasks_dsn, "--concurrency", "20", "--lease", "2")
    try:
        _enqueue_keyed(tasks_dsn, "per_key", keyed=True)
        wait_for(lambda: _count(tasks_dsn, "SELECT count(*) FROM keyed_runs") >= 30, timeout=30)
        # the worker that started a task last: its places free when its leases lapse
        last = _count(tasks_dsn, "SELECT pid FROM keyed_runs ORDER BY started DESC LIMIT 1")
        killed = next(w for w in workers if w.pid == last)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        killed_at = _now(tasks_dsn)
        wait_for(lambda: _count(tasks_dsn, "SELECT count(*) FROM outboxkit_tasks") == 0, timeout=60)
    finally:
        stop_workers(*workers)
    runs = _keyed_runs(tasks_dsn, killed.pid, killed_at)
    ran = _count(tasks_dsn, "SELECT count(DISTINCT task_id) FROM keyed_runs")
    assert_key_limit_kept(runs, ran, KEYED_TASKS, PER_KEY)


def test_three_workers_start_each_key_at_its_per_key_rate_plus_the_burst(tasks_dsn: str) -> None:
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute(KEYED_DDL)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for i in range(3 * KEY_PACED):
            tasks.enqueue(conn, "key_paced", key=f"tenant-{i % 3}")
    drain(tasks_dsn, "--concurrency", "20", timeout=30)
    with psycopg.connect(tasks_dsn) as conn:
        rows = conn.execute(
            "SELECT key, extract(epoch FROM started)::float8 FROM keyed_runs ORDER BY 2"
        ).fetchall()
    assert len(rows) == 3 * KEY_PACED  # each ran once: waiting spent no attempt
    for key in ("tenant-0", "tenant-1", "tenant-2"):
        starts = [s for k, s in rows if k == key]
        # at most 10 starts of a key in any one-second window, plus the burst (1)
        busiest = busiest_second(starts)
        assert busiest <= 11, (key, busiest)
        took = starts[-1] - starts[0]
        assert 3.5 <= took <= 6.0, (key, took)  # (40 - 1) / 10 = 3.9 s: not at once
