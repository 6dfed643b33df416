"""``Tasks.enqueue`` on MariaDB/MySQL: in the caller's transaction through every driver the
outbox write takes, with PostgreSQL's unique-key and per-key guarantees."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.tasks import Tasks
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import ASYNC, SYNC, Driver
from tests.support.mariadb_ops import mariadb_execute, new_database

tasks = Tasks()


@tasks.handler("mail.send")
def send(payload: dict[str, Any]) -> None:
    """Never run here: the tests read the table."""


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    url = new_database(mariadb_server)
    migrate(url, kind="tasks", table="outboxkit_tasks")
    yield url


def _rows(url: str) -> list[tuple[Any, ...]]:
    return mariadb_execute(url, "SELECT id, payload, status FROM outboxkit_tasks ORDER BY id")


@pytest.mark.parametrize("driver", SYNC, ids=str)
def test_every_sync_driver_enqueues_with_the_transaction_and_not_without(
    url: str, driver: Driver
) -> None:
    args = connect_args(url)
    with driver.transaction(args, url) as conn:
        task_id = tasks.enqueue(conn, "mail.send", {"to": "a"})
    with pytest.raises(RuntimeError, match="business failure"):
        with driver.transaction(args, url) as conn:
            tasks.enqueue(conn, "mail.send", {"to": "rolled back"})
            raise RuntimeError("business failure")
    assert _rows(url) == [(task_id, '{"to":"a"}', 0)]


@pytest.mark.parametrize("driver", ASYNC, ids=str)
async def test_every_async_driver_enqueues_with_the_transaction_and_not_without(
    url: str, driver: Driver
) -> None:
    args = connect_args(url)
    async with driver.transaction(args, url) as conn:
        task_id = await tasks.aenqueue(conn, "mail.send", {"to": "a"}, delay=60)
    with pytest.raises(RuntimeError, match="business failure"):
        async with driver.transaction(args, url) as conn:
            await tasks.aenqueue(conn, "mail.send", {"to": "rolled back"})
            raise RuntimeError("business failure")
    assert _rows(url) == [(task_id, '{"to":"a"}', 0)]
    (later,) = mariadb_execute(url, "SELECT available_at > UTC_TIMESTAMP(6) FROM outboxkit_tasks")
    assert later == (1,)  # the delay on the database's clock


def _begin(url: str) -> Any:
    conn = pymysql.connect(**connect_args(url))
    conn.begin()
    return conn


@pytest.mark.parametrize("first_commits", [True, False], ids=["commit", "rollback"])
def test_a_second_unique_key_waits_for_the_first_then_skips_or_takes_its_place(
    url: str, first_commits: bool
) -> None:
    """No partial unique index on MariaDB: the unique index on a generated column (the key's
    digest while the task is live) waits as PostgreSQL's does, and a rollback frees it."""
    first, second = _begin(url), _begin(url)
    try:
        one = tasks.enqueue(first, "mail.send", {"n": 1}, unique_key="welcome:42")
        got: list[int | None] = []
        racing = threading.Thread(
            target=lambda: got.append(
                tasks.enqueue(second, "mail.send", {"n": 2}, unique_key="welcome:42")
            )
        )
        racing.start()
        time.sleep(0.3)
        assert racing.is_alive()  # waits on the first transaction's key
        first.commit() if first_commits else first.rollback()
        racing.join(10)
        second.commit()
    finally:
        first.close()
        second.close()
    if first_commits:
        assert got == [None] and [r[0] for r in _rows(url)] == [one]
    else:
        assert got[0] is not None and [r[1] for r in _rows(url)] == ['{"n":2}']
    # a finished task frees its key: the next enqueue of it inserts
    mariadb_execute(url, "UPDATE outboxkit_tasks SET status = 2")
    conn = _begin(url)
    try:
        assert tasks.enqueue(conn, "mail.send", {"n": 3}, unique_key="welcome:42") is not None
        conn.commit()
    finally:
        conn.close()


def test_a_keys_ids_follow_its_commit_order_and_later_tasks_wait_their_turn(url: str) -> None:
    """Two transactions enqueue one key: the second waits on the key's lock row until the
    first commits, so its id is the later one; behind a live task the next one waits."""
    first, second = _begin(url), _begin(url)
    try:
        a = tasks.enqueue(first, "mail.send", {"n": 1}, key="tenant-1")
        got: list[int | None] = []
        racing = threading.Thread(
            target=lambda: got.append(tasks.enqueue(second, "mail.send", {"n": 2}, key="tenant-1"))
        )
        racing.start()
        time.sleep(0.3)
        assert racing.is_alive()
        first.commit()
        racing.join(10)
        second.commit()
    finally:
        first.close()
        second.close()
    assert a is not None and got[0] is not None and got[0] > a
    assert [r[2] for r in _rows(url)] == [0, 5]  # the second waits for its key's turn


async def test_an_enqueue_in_the_workers_process_wakes_it_without_notify(url: str) -> None:
    """No LISTEN/NOTIFY on MariaDB: a worker polling every 30 s runs a task enqueued (and
    committed) in its own process within a second (backends/mariadb/wakeup.py)."""
    import asyncio

    from outboxkit.tasks import Worker

    local = Tasks()
    ran = asyncio.Event()

    @local.handler("ping")
    async def ping(payload: None) -> None:
        ran.set()

    worker = Worker(local, url, poll_interval=30.0)
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.sleep(1.0)  # started, found nothing, waiting on its gate

        def enqueue() -> None:
            conn = _begin(url)
            try:
                local.enqueue(conn, "ping")
                conn.commit()
            finally:
                conn.close()

        await asyncio.to_thread(enqueue)
        started = time.monotonic()
        await asyncio.wait_for(ran.wait(), timeout=5)
        assert time.monotonic() - started < 1.5
    finally:
        worker.stop()
        await running


def test_after_an_unknown_task_is_refused_and_after_a_live_one_waits(url: str) -> None:
    from outboxkit.tasks.errors import InvalidTaskError

    conn = _begin(url)
    try:
        up = tasks.enqueue(conn, "mail.send", {"n": 1})
        assert up is not None
        with pytest.raises(InvalidTaskError, match="do not exist"):
            tasks.enqueue(conn, "mail.send", {"n": 2}, after=[up, 999_999])
        conn.rollback()
        conn.begin()
        up = tasks.enqueue(conn, "mail.send", {"n": 1})
        assert up is not None
        down = tasks.enqueue(conn, "mail.send", {"n": 2}, after=[up])
        conn.commit()
    finally:
        conn.close()
    assert [(r[0], r[2]) for r in _rows(url)] == [(up, 0), (down, 5)]
    edges = mariadb_execute(url, "SELECT task_id, after_id FROM outboxkit_tasks_deps")
    assert edges == [(down, up)]
