"""Task lifecycle events on MariaDB end to end: `outboxkit worker --dsn mysql://…` processes
whose handlers opt in (``events=topic``), the MariaDB relay publishing to NATS JetStream,
read back from the broker. Each settle's events commit with it: one event per settled
outcome, none for a task whose enqueue rolled back, and none for the settle of a zombie
attempt (a worker frozen past its lease while another ran the task again)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pymysql
import pytest

from outboxkit import Relay
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.publishers.nats import NatsPublisher
from tests.integration.test_mariadb_tasks_end_to_end import stop, wait_for
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import mariadb_execute, new_database
from tests.support.mariadb_task_events_app import DDL, tasks

ROOT = Path(__file__).resolve().parents[2]
#: Seconds the zombie's first attempt of `slow` holds (the lease is 1.5 s).
HOLD = 3.0


@pytest.fixture
def events_url(mariadb_server: MariaDB) -> Iterator[str]:
    url = new_database(mariadb_server)
    migrate(url, kind="tasks", table="outboxkit_tasks")
    migrate(url)  # the outbox the events go to
    for statement in DDL:
        mariadb_execute(url, statement)
    yield url


def spawn_worker(url: str, topic: str, lease: float) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OUTBOXKIT_DSN": url,
        "EVENTS_TOPIC": topic,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    command = [sys.executable, "-m", "outboxkit", "worker", "--dsn", url, "--app",
               "tests.support.mariadb_task_events_app:tasks", "--poll-interval", "0.05",
               "--lease", str(lease), "--concurrency", "8"]  # fmt: skip
    return subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.DEVNULL)


def enqueue(url: str, jobs: list[tuple[str, dict[str, Any]]], *, commit: bool) -> list[int]:
    """One PyMySQL transaction enqueuing ``jobs``, committed or rolled back; their ids."""
    conn = pymysql.connect(**connect_args(url))
    try:
        conn.begin()
        ids = [tasks.enqueue(conn, name, payload) for name, payload in jobs]
        conn.commit() if commit else conn.rollback()
    finally:
        conn.close()
    return [int(i) for i in ids if i is not None]


def freeze(worker: subprocess.Popen[bytes], url: str) -> None:
    """SIGSTOP ``worker`` outside its claim's transactions: frozen inside one, its row locks
    (InnoDB's, of rows its claim read) would hide the task from every other worker's
    ``SKIP LOCKED`` until its connection died. It is the database's only client now."""
    for attempt in range(500):
        worker.send_signal(signal.SIGSTOP)
        time.sleep(0.02)  # (a statement it sent just before lands)
        if not mariadb_execute(url, "SELECT trx_id FROM information_schema.INNODB_TRX"):
            return
        worker.send_signal(signal.SIGCONT)
        # Longer each time: on a loaded machine 5 ms may not let it reach its COMMIT, and
        # each try froze it inside the same transaction again (seen under -n 2, load 11).
        time.sleep(min(0.1, 0.005 * (attempt + 1)))
    raise AssertionError("the worker was inside a transaction at every try")


def runs(url: str, task_id: int) -> list[int]:
    query = f"SELECT attempt FROM task_runs WHERE task_id = {int(task_id)} ORDER BY attempt"
    return [r[0] for r in mariadb_execute(url, query)]


def left(url: str) -> int:
    return len(mariadb_execute(url, "SELECT id FROM outboxkit_tasks WHERE status <> 3"))


async def relay_to_nats(url: str, broker: str) -> None:
    """The MariaDB relay until the outbox is empty."""
    relay = Relay(url, NatsPublisher.from_url(broker), poll_interval=0.05)
    running = asyncio.create_task(relay.run())
    try:
        async with asyncio.timeout(20):
            while mariadb_execute(url, "SELECT id FROM outbox LIMIT 1") and not running.done():
                await asyncio.sleep(0.05)
    finally:
        relay.stop()
        await running


async def published(nats_url: str, stream: str) -> list[tuple[int, int, str | None]]:
    """The stream's lifecycle events: (task id, attempt, error) each."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            body = json.loads((await js.get_msg(stream, seq)).data)
            found.append((body["task_id"], body["attempt"], body["error"]))
        await js.delete_stream(stream)
        return found
    finally:
        await nc.close()


def test_each_settle_publishes_its_events_once_and_rollbacks_and_zombies_none(
    events_url: str, nats_server: Any
) -> None:
    url = events_url
    tag = uuid.uuid4().hex[:8]
    topic, stream = f"{tag}.tasks", f"TASKS_{tag.upper()}"
    (slow,) = enqueue(url, [("ev.slow", {"hold": HOLD})], commit=True)
    zombie = spawn_worker(url, topic, lease=1.5)  # (its lease lapses soon once frozen)
    other = None
    try:
        wait_for(lambda: runs(url, slow) == [1])
        started = time.monotonic()
        freeze(zombie, url)  # frozen holding `slow`: its lease runs out
        committed = enqueue(url, [("ev.ok", {})] * 20 + [("ev.flaky", {})] * 3, commit=True)
        dead = enqueue(url, [("ev.dead", {})] * 2, commit=True)
        rolled_back = enqueue(url, [("ev.ok", {})] * 10 + [("ev.dead", {})] * 2, commit=False)
        # A long lease: no attempt of `other` lapses on a loaded machine (its settle would
        # be turned away, rightly without an event, and the attempts below shift).
        other = spawn_worker(url, topic, lease=15)
        wait_for(lambda: left(url) == 0, timeout=60)  # `slow` ran again by `other`, completed
        zombie.send_signal(signal.SIGCONT)  # its hold ends: its settle, fenced off
        time.sleep(max(0.0, started + HOLD + 0.5 - time.monotonic()))
    finally:
        zombie.send_signal(signal.SIGCONT)
        stop(zombie)
        if other is not None:
            stop(other)
    asyncio.run(relay_to_nats(url, f"{nats_server.url}?stream={stream}&subjects={tag}.>"))
    events = asyncio.run(published(nats_server.url, stream))
    # `slow`: the zombie's first attempt ran and published nothing; the second, a completion.
    assert runs(url, slow) == [1, 2]
    assert [e for e in events if e[0] == slow] == [(slow, 2, None)]
    # Every other task: one event per settled attempt (a failure, then the completion).
    expected = [(i, 1, None) for i in committed[:20]]
    expected += [(i, 1, "RuntimeError: first attempt fails") for i in committed[20:]]
    expected += [(i, 2, None) for i in committed[20:]]
    expected += [(i, 1, "RuntimeError: always fails") for i in dead]
    assert sorted(e for e in events if e[0] != slow) == sorted(expected)
    assert not {e[0] for e in events} & set(rolled_back)  # a rolled-back enqueue: none
