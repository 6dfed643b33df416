"""Results and paused queues on MariaDB/MySQL: ``Tasks.result``, ``wait``, ``await_result``,
``pause`` and ``resume`` through the backend's TaskAdmin, with a worker in the process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import TaskNotFound
from outboxkit.tasks import Tasks, Worker
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import new_database

tasks = Tasks()


@tasks.handler("square", keep_result=60)
async def square(payload: dict[str, int]) -> int:
    return payload["n"] ** 2


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    url = new_database(mariadb_server)
    migrate(url, kind="tasks", table="outboxkit_tasks")
    yield url


def _enqueue(url: str, n: int, queue: str = "default") -> int:
    conn = pymysql.connect(**connect_args(url))
    try:
        conn.begin()
        task_id = tasks.enqueue(conn, "square", {"n": n}, queue=queue)
        conn.commit()
    finally:
        conn.close()
    assert task_id is not None
    return task_id


async def test_a_kept_result_is_waited_for_read_and_a_paused_queue_holds_its_tasks(
    url: str,
) -> None:
    first = _enqueue(url, 3)
    assert tasks.pause(url, "slow") and not tasks.pause(url, "slow")  # a repeat says so
    held = _enqueue(url, 4, queue="slow")
    worker = Worker(tasks, url, queues=["default", "slow"], poll_interval=0.1)
    running = asyncio.create_task(worker.run())
    try:
        done = await asyncio.to_thread(tasks.wait, url, first, timeout=10)
        assert (done.status, done.value) == ("done", 9)
        result = tasks.result(url, held)
        assert result is not None and result.status == "queued"  # paused: not claimed
        with pytest.raises(TimeoutError, match="queued after 0 attempt"):
            await tasks.await_result(url, held, timeout=0.3)
        assert tasks.resume(url, "slow") and not tasks.resume(url, "slow")
        later = await tasks.await_result(url, held, timeout=10)
        assert later.value == 16
    finally:
        worker.stop()
        await running
    with pytest.raises(TaskNotFound):
        tasks.wait(url, 999_999, timeout=1)
    conn: Any = pymysql.connect(**connect_args(url))  # in a transaction: refused
    try:
        with pytest.raises(TypeError, match="autocommit"):
            tasks.wait(conn, first, timeout=1)
    finally:
        conn.close()
