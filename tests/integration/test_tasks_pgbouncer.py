"""Task mode behind PgBouncer in transaction pooling mode (the suite's own, tests/support).

As the relay (test_pgbouncer.py): claims, settles and handlers' transactions go through the
pooler; what needs a session (LISTEN, the wake-up gate's advisory lock) goes to
``direct_dsn`` or is not done at all, and the poll finds every task.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.tasks import TaskContext, Tasks, Worker
from tests.support.pgbouncer import PgBouncer


@pytest.fixture
def pooled_dsn(db_dsn: str, pgbouncer: PgBouncer) -> str:
    migrate_tasks(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE side_effects (task_id bigint PRIMARY KEY)")
    return pgbouncer.dsn_for(psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"])


def _advisory_locks(dsn: str) -> int:
    """Advisory locks held in this database by any session (a leaked gate lock shows here)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _tasks(done: list[int]) -> Tasks:
    tasks = Tasks()

    @tasks.handler("write")
    async def write(payload: int, ctx: TaskContext) -> None:
        async with ctx.atransaction() as conn:  # through the pooler, with the completion
            await conn.execute("INSERT INTO side_effects VALUES (%s)", (ctx.id,))
        done.append(payload)

    return tasks


async def _run(worker: Worker, until: Callable[[], bool], timeout: float = 15.0) -> None:
    running = asyncio.create_task(worker.run())
    deadline = time.monotonic() + timeout
    while not until() and not running.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    worker.stop()
    await running


def _enqueue(dsn: str, tasks: Tasks, numbers: range) -> None:
    # The application's own connection: no prepared statements through this pooler (README).
    with psycopg.connect(dsn, prepare_threshold=None) as conn:
        for n in numbers:
            with conn.transaction():
                tasks.enqueue(conn, "write", n)


def test_a_worker_behind_the_pooler_polls_says_so_once_and_leaks_no_session_lock(
    pooled_dsn: str, db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    done: list[int] = []
    tasks = _tasks(done)
    _enqueue(pooled_dsn, tasks, range(20))
    worker = Worker(tasks, pooled_dsn, pooler="transaction", poll_interval=0.05, concurrency=4)

    async def main() -> None:
        # Idle spells in between, so the worker tries to close its wake-up gate many times.
        run = asyncio.create_task(_run(worker, lambda: len(done) == 40))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(_enqueue, pooled_dsn, tasks, range(20, 40))
        await run

    with caplog.at_level(logging.WARNING, logger="outboxkit.worker"):
        asyncio.run(main())
    assert sorted(done) == list(range(40))
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM side_effects").fetchone() == (40,)
        assert conn.execute("SELECT count(*) FROM outboxkit_tasks").fetchone() == (0,)
    told = [r for r in caplog.records if "transaction pooler" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in told]
    assert "--direct-dsn" in told[0].getMessage()
    # The gate's lock is a session's: taken through the pooler it would stay on whichever
    # server connection ran it, shutting the gate for every worker.
    assert _advisory_locks(db_dsn) == 0


def test_with_a_direct_dsn_an_idle_worker_behind_the_pooler_is_woken_at_once(
    pooled_dsn: str, db_dsn: str
) -> None:
    done: list[int] = []
    tasks = _tasks(done)
    # A poll far too slow to explain a start within seconds: only a wake-up can.
    worker = Worker(tasks, pooled_dsn, pooler="transaction", direct_dsn=db_dsn, poll_interval=60.0)
    started: list[float] = []

    async def main() -> None:
        run = asyncio.create_task(_run(worker, lambda: len(done) == 5, timeout=20.0))
        await asyncio.sleep(1.0)  # idle: the gate closed on the direct connection
        for n in range(5):
            sent = time.monotonic()
            await asyncio.to_thread(_enqueue, pooled_dsn, tasks, range(n, n + 1))
            while len(done) <= n and time.monotonic() - sent < 5.0:
                await asyncio.sleep(0.005)
            started.append(time.monotonic() - sent)
            await asyncio.sleep(0.2)
        await run

    asyncio.run(main())
    assert sorted(done) == list(range(5))
    assert max(started) < 3.0, started
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM side_effects").fetchone() == (5,)
    assert _advisory_locks(db_dsn) == 0


def test_a_direct_dsn_through_the_pooler_is_refused(pooled_dsn: str) -> None:
    tasks = _tasks([])
    worker = Worker(
        tasks, pooled_dsn, pooler="transaction", direct_dsn=pooled_dsn + "?pooler=transaction"
    )
    with pytest.raises(Exception, match="--direct-dsn goes through a transaction pooler"):
        asyncio.run(worker.run())


def _periodic_behind_the_pooler(
    dsn: str, seconds: float, until: Callable[[list[str]], bool] | None = None
) -> tuple[list[int], list[str]]:
    """Three workers behind the pooler, a task every second, slots looked for every 50 ms:
    the tasks run and the worker's warnings (``seconds``, or less once ``until(warnings)``)."""
    tasks = Tasks()
    runs: list[int] = []

    @tasks.periodic("* * * * * *", "tick", catch_up="none")
    async def tick(payload: None, ctx: TaskContext) -> None:
        runs.append(ctx.id)

    workers = [
        Worker(tasks, dsn, pooler="transaction", poll_interval=0.05, periodic_tick=0.05)
        for _ in range(3)
    ]
    warnings: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    handler = _Keep(logging.WARNING)
    logger = logging.getLogger("outboxkit.worker")
    logger.addHandler(handler)

    async def main() -> None:
        running = [asyncio.create_task(w.run()) for w in workers]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and until(warnings)):
            await asyncio.sleep(0.05)
        for w in workers:
            w.stop()
        await asyncio.gather(*running)

    try:
        asyncio.run(main())
    finally:
        logger.removeHandler(handler)
    return runs, warnings


def _slots(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT task_id, slot FROM outboxkit_schedules ORDER BY slot"
        ).fetchall()


def test_periodic_tasks_behind_the_pooler_run_once_per_slot_across_three_workers(
    pooled_dsn: str, db_dsn: str
) -> None:
    started = time.monotonic()
    runs, warnings = _periodic_behind_the_pooler(pooled_dsn, 3.3)
    elapsed = time.monotonic() - started
    recorded = _slots(db_dsn)
    assert 2 <= len(recorded) <= elapsed + 1
    assert sorted(runs) == sorted(task_id for task_id, _slot in recorded)  # once each
    assert not [w for w in warnings if "periodic" in w], warnings
    assert _advisory_locks(db_dsn) == 0


def test_a_periodic_connection_that_prepares_statements_fails_behind_the_pooler(
    pooled_dsn: str, db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The naive way: the periodic side task's connection taken for PostgreSQL itself."""
    from outboxkit.backends.postgres.backend import PostgresBackend
    from outboxkit.backends.postgres.tasks_pg import PgSchedules

    def naive(_self: Any, dsn: str, table: str, *, pooler: Any = None) -> PgSchedules:
        return PgSchedules(dsn, table, pooler="none")

    monkeypatch.setattr(PostgresBackend, "schedules", naive)

    def failed(warnings: list[str]) -> list[str]:
        return [w for w in warnings if w.startswith("periodic tasks:")]

    # Other clients' transactions keep more server connections busy, as in production: a
    # statement prepared on one is then looked for on another. Without them the three
    # periodic connections could each keep landing on a server that has it (CI on b95cc3e).
    stop = threading.Event()

    def churn() -> None:
        with psycopg.connect(pooled_dsn, autocommit=True, prepare_threshold=None) as conn:
            while not stop.is_set():
                conn.execute("SELECT pg_sleep(0.003)")

    others = [threading.Thread(target=churn, daemon=True) for _ in range(4)]
    for t in others:
        t.start()
    try:
        _runs, warnings = _periodic_behind_the_pooler(
            pooled_dsn, 15.0, until=lambda w: bool(failed(w))
        )
    finally:
        stop.set()
        for t in others:
            t.join(timeout=5)
    assert any("prepared statement" in w for w in failed(warnings)), warnings
