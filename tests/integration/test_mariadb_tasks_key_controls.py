"""The controls per key through MariaDB's worker (`Worker(tasks, "mysql://…")`, in the
process): a name with ``rate_per_key`` and ``concurrency_per_key`` starts each key at its
rate, every task once; and a task table of version 1 (before the key buckets) is refused at
the worker's start with the command that upgrades it, which then does. The claim's rules
themselves are the task-store contract's (tests/contract/test_task_store.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pymysql
import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import VERSIONS_TABLE, connect_args
from outboxkit.backends.mariadb.tasks import MariaDBTaskStore
from outboxkit.errors import SchemaError
from outboxkit.tasks import TaskContext, Tasks, Worker
from tests.integration.test_tasks_limits import busiest_second
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import mariadb_execute, new_database

TABLE = "outboxkit_tasks"
PER_KEY = 12  # tasks of each of three keys
tasks = Tasks()
starts: dict[str, list[float]] = {}


@tasks.handler("paced", rate_per_key="10/s", concurrency_per_key=5)
async def paced(payload: None, ctx: TaskContext) -> None:
    """At most 10 starts a second of each key across every worker (+ the burst of 1)."""
    assert ctx.key is not None
    starts.setdefault(ctx.key, []).append(time.monotonic())


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    url = new_database(mariadb_server)
    migrate(url, kind="tasks", table=TABLE)
    yield url


async def test_a_worker_starts_each_key_at_its_rate_and_runs_every_task_once(url: str) -> None:
    conn = pymysql.connect(**connect_args(url))
    try:
        conn.begin()
        for i in range(3 * PER_KEY):
            tasks.enqueue(conn, "paced", None, key=f"tenant-{i % 3}")
        conn.commit()
    finally:
        conn.close()
    starts.clear()
    worker = Worker(tasks, url, poll_interval=0.05, concurrency=20)
    running = asyncio.create_task(worker.run())
    try:
        deadline = time.monotonic() + 20
        while mariadb_execute(url, f"SELECT 1 FROM {TABLE} LIMIT 1"):
            assert time.monotonic() < deadline, starts
            await asyncio.sleep(0.05)
    finally:
        worker.stop()
        await running
    assert sorted(starts) == ["tenant-0", "tenant-1", "tenant-2"]
    for key, started in starts.items():
        assert len(started) == PER_KEY, key  # each ran once: waiting spent no attempt
        assert busiest_second(started) <= 11, (key, busiest_second(started))
        took = started[-1] - started[0]
        # (12 - 1) / 10 = 1.1 s: not at once; the upper bound only catches a stall (the
        # claim waiting out a poll per task would take 11 s), with room for a loaded machine
        assert 1.0 <= took <= 8.0, (key, took)


async def test_a_task_table_without_the_key_buckets_is_refused_until_migrated(url: str) -> None:
    """A table of version 1 (no <table>_key_rates): the worker's start names the command."""
    mariadb_execute(url, f"DROP TABLE {TABLE}_key_rates")
    mariadb_execute(url, f"DELETE FROM {VERSIONS_TABLE} WHERE kind = 'tasks' AND version = 2")
    store = MariaDBTaskStore(url, TABLE, per_key={"paced": 5})
    try:
        with pytest.raises(SchemaError, match="outboxkit migrate --tasks"):
            await store.start()
    finally:
        await store.close()
    assert migrate(url, kind="tasks", table=TABLE).applied == [2]
    store = MariaDBTaskStore(url, TABLE, per_key={"paced": 5})
    try:
        assert (await store.start()).pending == 0
    finally:
        await store.close()
