"""Periodic tasks: one run per slot across several workers, restarts included; the first two
on PostgreSQL and on the private mariadbd alike (MariaDB's slot is an ``INSERT IGNORE`` in the
transaction of the task it enqueues)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.tasks import TaskContext, Tasks, Worker
from tests.support.mariadb_ops import mariadb_execute, task_database


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    yield db_dsn


@pytest.fixture(params=["postgresql", "mariadb"])
def either_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """A task table on PostgreSQL, or on the private mariadbd."""
    yield task_database(request)


def _sql(dsn: str, statement: str) -> list[tuple[Any, ...]]:
    if not dsn.startswith("postgresql"):
        return mariadb_execute(dsn, statement)
    with psycopg.connect(dsn) as conn:  # committed at the end of the block
        cur = conn.execute(statement)
        return cur.fetchall() if cur.description else []


def slots(dsn: str) -> list[tuple[Any, ...]]:
    return _sql(dsn, "SELECT task_id, slot FROM outboxkit_schedules ORDER BY slot")


def test_three_workers_run_each_slot_exactly_once(either_dsn: str) -> None:
    tasks_dsn = either_dsn
    tasks = Tasks()
    runs: list[int] = []

    @tasks.periodic("* * * * * *", "tick", catch_up="none")
    async def tick(payload: None, ctx: TaskContext) -> None:
        runs.append(ctx.id)

    workers = [Worker(tasks, tasks_dsn, poll_interval=0.05, periodic_tick=0.2) for _ in range(3)]

    async def main() -> None:
        running = [asyncio.create_task(w.run()) for w in workers]
        await asyncio.sleep(3.3)
        for w in workers:
            w.stop()
        await asyncio.gather(*running)

    started = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - started
    recorded = slots(tasks_dsn)
    assert 2 <= len(recorded) <= elapsed + 1
    assert sorted(runs) == sorted(task_id for task_id, _slot in recorded)  # once each


def test_a_worker_restarted_inside_a_period_does_not_run_it_twice(either_dsn: str) -> None:
    tasks_dsn = either_dsn
    tasks = Tasks()
    runs: list[int] = []
    tasks.periodic("0 * * * *", "hourly", catch_up="last")(lambda payload: runs.append(1))
    # The slot of this hour ran already (recorded), as if by a worker that was restarted.
    this_hour = (
        "date_trunc('hour', now())"
        if tasks_dsn.startswith("postgresql")
        else "DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%d %H:00:00')"
    )
    _sql(
        tasks_dsn,
        "INSERT INTO outboxkit_schedules (schedule, slot)"
        f" VALUES ('hourly 0 * * * *', {this_hour})",
    )
    for _ in range(2):
        worker = Worker(tasks, tasks_dsn, poll_interval=0.05, periodic_tick=0.1)

        async def main(worker: Worker = worker) -> None:
            running = asyncio.create_task(worker.run())
            await asyncio.sleep(0.5)
            worker.stop()
            await running

        asyncio.run(main())
    assert runs == []
    assert len(slots(tasks_dsn)) == 1


def test_a_schedules_old_slots_are_pruned_but_its_newest_stays(tasks_dsn: str) -> None:
    """outboxkit_schedules kept one row per slot for ever (86 400 a day for a per-second
    cron). A worker prunes slots older than a day at start and hourly; each schedule's
    newest slot stays (a worker's view of the schedule starts there)."""
    tasks = Tasks()
    tasks.periodic("0 0 1 1 *", "yearly", catch_up="none")(lambda payload: None)
    with psycopg.connect(tasks_dsn) as conn:
        conn.execute(
            "INSERT INTO outboxkit_schedules (schedule, slot)"
            " SELECT 'per-second', now() - make_interval(secs => n)"
            " FROM generate_series(1, 12000) AS n"  # 3.3 hours, every second
        )
        conn.execute(  # a schedule that last ran long ago: its one slot stays
            "INSERT INTO outboxkit_schedules (schedule, slot)"
            " VALUES ('monthly', now() - interval '40 days')"
        )
        conn.execute(
            "INSERT INTO outboxkit_schedules (schedule, slot)"
            " SELECT 'old', now() - interval '2 days' - make_interval(secs => n)"
            " FROM generate_series(0, 11999) AS n"
        )
        conn.commit()
    worker = Worker(tasks, tasks_dsn, poll_interval=0.05, periodic_tick=0.1)

    def counts() -> dict[str, int]:
        with psycopg.connect(tasks_dsn) as conn:
            return dict(
                conn.execute(
                    "SELECT schedule, count(*) FROM outboxkit_schedules GROUP BY schedule"
                ).fetchall()
            )

    async def main() -> None:
        run = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 15
        while counts().get("old", 0) != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        worker.stop()
        await run

    asyncio.run(main())
    assert counts() == {"per-second": 12000, "monthly": 1, "old": 1}
