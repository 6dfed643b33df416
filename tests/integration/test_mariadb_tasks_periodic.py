"""Periodic tasks on the private mariadbd: one run per slot across three workers, and a
worker restarted inside a period does not run it again (test_tasks_periodic.py's scenarios,
through MariaDB's schedules: ``INSERT IGNORE`` of the slot and its task in one transaction)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.tasks import TaskContext, Tasks, Worker
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import mariadb_execute, new_database


@pytest.fixture
def tasks_url(mariadb_server: MariaDB) -> Iterator[str]:
    url = new_database(mariadb_server)
    migrate(url, kind="tasks", table="outboxkit_tasks")
    yield url


def slots(url: str) -> list[tuple[int | None, object]]:
    return [
        (None if task_id is None else int(task_id), slot)
        for task_id, slot in mariadb_execute(
            url, "SELECT task_id, slot FROM outboxkit_schedules ORDER BY slot"
        )
    ]


def test_three_workers_on_mariadb_run_each_slot_exactly_once(tasks_url: str) -> None:
    tasks = Tasks()
    runs: list[int] = []

    @tasks.periodic("* * * * * *", "tick", catch_up="none")
    async def tick(payload: None, ctx: TaskContext) -> None:
        runs.append(ctx.id)

    workers = [Worker(tasks, tasks_url, poll_interval=0.05, periodic_tick=0.2) for _ in range(3)]

    async def main() -> None:
        running = [asyncio.create_task(w.run()) for w in workers]
        await asyncio.sleep(3.3)
        for w in workers:
            w.stop()
        await asyncio.gather(*running)

    started = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - started
    recorded = slots(tasks_url)
    assert 2 <= len(recorded) <= elapsed + 1
    assert len({slot for _id, slot in recorded}) == len(recorded)
    assert sorted(runs) == sorted(task_id for task_id, _slot in recorded)  # once each


def test_a_worker_restarted_inside_a_period_on_mariadb_does_not_run_it_twice(
    tasks_url: str,
) -> None:
    tasks = Tasks()
    runs: list[int] = []
    tasks.periodic("0 * * * *", "hourly", catch_up="last")(lambda payload: runs.append(1))
    # The slot of this hour ran already (recorded), as if by a worker that was restarted.
    mariadb_execute(
        tasks_url,
        "INSERT INTO outboxkit_schedules (schedule, slot) VALUES"
        " ('hourly 0 * * * *', DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%d %H:00:00'))",
    )
    for _ in range(2):
        worker = Worker(tasks, tasks_url, poll_interval=0.05, periodic_tick=0.1)

        async def main(worker: Worker = worker) -> None:
            running = asyncio.create_task(worker.run())
            await asyncio.sleep(0.5)
            worker.stop()
            await running

        asyncio.run(main())
    assert runs == []
    assert len(slots(tasks_url)) == 1
