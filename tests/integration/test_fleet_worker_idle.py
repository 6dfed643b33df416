"""An idle database of ``outboxkit worker --dsn-file`` holds its LISTEN session only.

Real worker processes over three databases of the session's PostgreSQL, a 30 s poll: first
as before parking (``OUTBOXKIT_CLAIM_IDLE=0``: claim, settle and LISTEN held per idle
database), then parked (``OUTBOXKIT_CLAIM_IDLE=1``, ``OUTBOXKIT_SETTLE_IDLE=1``): the LISTEN
session alone, which hears an enqueue at once, learns a delayed task's due time and claims
then (not at the poll), and hears a paused queue resumed.
"""

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

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.tasks_pg import pause_queue, resume_queue
from outboxkit.testing import create_database, drop_database
from tests.support.relaying import wait_for
from tests.support.servers import unique_name
from tests.support.tasks_app import tasks

pytestmark = [pytest.mark.exclusive, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
KEPT = {"outboxkit-worker:claim": 1, "outboxkit-worker:settle": 1, "outboxkit-worker:listen": 1}
PARKED = {"outboxkit-worker:listen": 1}
DELAY = 3.0


@pytest.fixture
def databases(pg_server: Any) -> Iterator[list[str]]:
    """Three fresh databases with the task table and an effects table (with its time)."""
    names = [unique_name("fleetwpark") for _ in range(3)]
    dsns = []
    for name in names:
        create_database(pg_server.dsn, name)
        dsn = pg_server.dsn_for(name)
        migrate_tasks(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE effects (task_id bigint, attempt int,"
                " at timestamptz DEFAULT clock_timestamp())"
            )
        dsns.append(dsn)
    try:
        yield dsns
    finally:
        for name in names:
            drop_database(pg_server.dsn, name)


def held(dsn: str) -> dict[str, int]:
    """The worker's connections to ``dsn``'s database now, by application_name."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE 'outboxkit-worker:%'"
            " GROUP BY 1"
        ).fetchall()
    return {name: int(n) for name, n in rows}


def enqueue(dsn: str, n: int = 1, **options: Any) -> float:
    """``n`` effect tasks; the last one's due time (epoch seconds)."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        ids = [tasks.enqueue(conn, "effect", {"ms": 1}, **options) for _ in range(n)]
        row = conn.execute(
            "SELECT extract(epoch FROM available_at)::float8 FROM outboxkit_tasks WHERE id = %s",
            (ids[-1],),
        ).fetchone()
    assert row is not None
    return float(row[0])


def effects(dsn: str) -> tuple[int, int, float | None]:
    """Runs, distinct tasks run, the last run's time (epoch seconds)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT task_id), extract(epoch FROM max(at))::float8"
            " FROM effects"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), row[2]


def spawn(dsn_file: Path, log: Path, claim_idle: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("OUTBOXKIT_DSN", None)
    env.update(OUTBOXKIT_CLAIM_IDLE=claim_idle, OUTBOXKIT_SETTLE_IDLE="1")
    command = [sys.executable, "-m", "outboxkit", "worker", "--dsn-file", str(dsn_file)]
    command += ["--app", "tests.support.tasks_app:tasks", "--poll-interval", "30"]
    command += ["--reload-interval", "3600"]
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(30)


async def test_idle_databases_of_a_worker_fleet_hold_their_listen_session_only(
    databases: list[str], tmp_path: Path
) -> None:
    dsn_file = tmp_path / "databases.txt"
    dsn_file.write_text("".join(f"db{i} {dsn}\n" for i, dsn in enumerate(databases)))
    log = tmp_path / "worker.log"
    db0, db1, db2 = databases

    # Before parking (a claim connection kept for good): claim, settle (the sweeps every
    # second keep it open) and LISTEN per idle database.
    kept = spawn(dsn_file, log, "0")
    try:
        await wait_for(lambda: all(held(d) == KEPT for d in databases), timeout=15, what="kept")
        time.sleep(1.5)  # (longer than OUTBOXKIT_SETTLE_IDLE: still held)
        assert [held(d) for d in databases] == [KEPT] * 3
    finally:
        stop(kept)

    process = spawn(dsn_file, log, "1")
    try:
        await wait_for(lambda: all(held(d) == PARKED for d in databases), timeout=15, what="parked")

        # An enqueue in a parked database: its NOTIFY unparks the worker, the tasks run now.
        committed = time.time()
        enqueue(db0, 20)
        await wait_for(lambda: effects(db0)[1] == 20, timeout=10, what="db0's tasks")
        ran_in = time.time() - committed
        assert ran_in < 3, f"run {ran_in:.1f}s after the enqueue: by the poll?"

        # A delayed task in a parked database: its enqueue says LATER, the parked worker
        # probes for its due time on the LISTEN session and claims then (the poll is 30 s).
        due = enqueue(db1, delay=DELAY)
        assert held(db1) == PARKED
        await wait_for(lambda: effects(db1)[1] == 1, timeout=DELAY + 10, what="the delayed task")
        late = (effects(db1)[2] or 0) - due
        assert 0 <= late < 1.0, f"the delayed task ran {late:+.2f}s after it was due"

        # A paused queue: its task due now wakes the worker, which claims nothing and parks
        # again; the resume notifies, the task runs.
        pause_queue(db2, "outboxkit_tasks", "default")
        enqueue(db2)
        await wait_for(lambda: held(db2) == PARKED, timeout=10, what="db2 parked, paused")
        assert effects(db2)[1] == 0
        resumed = time.time()
        resume_queue(db2, "outboxkit_tasks", "default")
        await wait_for(lambda: effects(db2)[1] == 1, timeout=10, what="the resumed queue's task")
        resumed_in = time.time() - resumed
        assert resumed_in < 3, f"run {resumed_in:.1f}s after the resume: by the poll?"

        # Each task ran once; every database parked again (its settle connection closed).
        assert [effects(d)[:2] for d in databases] == [(20, 20), (1, 1), (1, 1)]
        await wait_for(lambda: all(held(d) == PARKED for d in databases), timeout=15, what="idle")
        print(f"enqueue -> run {ran_in * 1000:.0f} ms; delayed task {late:+.2f}s after due")
    finally:
        stop(process)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


async def test_a_parked_worker_runs_its_periodic_tasks_at_their_slots(db_dsn: str) -> None:
    """A worker served as a fleet serves each database (``claim_idle`` set, a 30 s poll):
    parked between two slots of a schedule every 3 s, it runs each slot's task within a
    second of the slot (the periodic side task's wake, then the probe on the LISTEN session),
    and holds no claim connection between them."""
    import asyncio
    import datetime as dt

    from outboxkit.queue.idle import claim_idle
    from outboxkit.tasks import TaskContext, Tasks, Worker

    migrate_tasks(db_dsn)
    app = Tasks()
    late: list[float] = []

    @app.periodic("*/3 * * * * *", "tick", catch_up="none")
    async def tick(payload: None, ctx: TaskContext) -> None:
        now = dt.datetime.now(dt.UTC)
        late.append(now.timestamp() % 3)  # (since its slot: a multiple of 3 s)

    worker = Worker(app, db_dsn, poll_interval=30, periodic_tick=0.2)
    token = claim_idle.set(1.0)  # (what the fleet sets in each database's context)
    running = asyncio.create_task(worker.run())
    claim_idle.reset(token)
    try:
        parked_runs = []
        deadline = time.monotonic() + 15
        while len(parked_runs) < 2 and time.monotonic() < deadline:
            now_held = held(db_dsn)  # (parked: after a run, its claim connection closed)
            if (
                late
                and "outboxkit-worker:listen" in now_held
                and not now_held.get("outboxkit-worker:claim")
            ):
                before = len(late)  # parked: the next slot's task must run all the same
                while len(late) == before and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                parked_runs.append(late[-1])
            await asyncio.sleep(0.05)
    finally:
        worker.stop()
        await running
    assert len(parked_runs) == 2, f"parked runs {parked_runs}, all runs {late}"
    assert max(parked_runs) < 1.0, f"run {parked_runs} s after their slots"
