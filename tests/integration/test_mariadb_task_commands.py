"""`outboxkit tasks …` on a mysql:// DSN, through the backend's TaskAdmin: real rows made by
real enqueues and a real Worker (a failed task, a done one kept, pending ones), each
command's effect read back from the table, its --json parsed; and the worker's task gauges
read from the same table."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest
from click.testing import CliRunner

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.ops.cli import main
from outboxkit.ops.task_metrics import _TableGauges
from outboxkit.tasks import Tasks, Worker
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import mariadb_execute, new_database

tasks = Tasks()


@tasks.handler("square")
async def square(payload: dict[str, int]) -> int:
    return payload["n"] ** 2


@tasks.handler("boom", max_attempts=1)
async def boom(payload: dict[str, int]) -> None:
    raise ValueError(f"card {payload['n']} declined")


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    url = new_database(mariadb_server)
    migrate(url, kind="tasks", table="outboxkit_tasks")
    yield url


def _enqueue(url: str, name: str, n: int, **options: Any) -> int:
    conn = pymysql.connect(**connect_args(url))
    try:
        conn.begin()
        task_id = tasks.enqueue(conn, name, {"n": n}, **options)
        conn.commit()
    finally:
        conn.close()
    assert task_id is not None
    return task_id


def _run(url: str, *args: str) -> str:
    result = CliRunner().invoke(main, ["tasks", *args, "--dsn", url], catch_exceptions=False)
    assert result.exit_code == 0, (args, result.output)
    return result.output


def _json(url: str, *args: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _run(url, *args, "--json").splitlines()]


def _states(url: str) -> dict[int, tuple[int, int]]:
    rows = mariadb_execute(url, "SELECT id, status, attempts FROM outboxkit_tasks")
    return {int(i): (int(s), int(a)) for i, s, a in rows}


async def _settle(url: str, ids: list[int]) -> None:
    """A real worker (finished tasks kept) until ``ids`` are all finished."""
    worker = Worker(tasks, url, queues=["default"], poll_interval=0.05, retention="keep")
    running = asyncio.create_task(worker.run())
    try:
        for _ in range(200):
            if all(_states(url)[i][0] in (2, 3) for i in ids):  # done or failed
                break
            await asyncio.sleep(0.05)
    finally:
        worker.stop()
        await running


async def test_every_task_command_reads_and_acts_on_a_mariadb_task_table(url: str) -> None:
    done = _enqueue(url, "square", 3)
    keyed = _enqueue(url, "boom", 1, unique_key="order-1")
    failed = _enqueue(url, "boom", 2)
    await _settle(url, [done, keyed, failed])
    live = _enqueue(url, "square", 4, queue="later", unique_key="order-1")  # holds the key
    pending = _enqueue(url, "square", 5, queue="later")

    listed = {r["id"]: r for r in _json(url, "list")}
    assert {i: r["status"] for i, r in listed.items()} == {
        done: "done", keyed: "failed", failed: "failed", live: "pending", pending: "pending"
    }  # fmt: skip
    assert listed[pending]["due"] is True and listed[pending]["queue"] == "later"
    assert listed[failed]["error_type"] == "ValueError"
    assert [r["id"] for r in _json(url, "failed")] == [keyed, failed]
    assert [r["id"] for r in _json(url, "list", "--queue", "later", "--limit", "1")] == [live]
    table = _run(url, "failed")
    assert "failed tasks" in table and "ValueError: card 2 declined" in table

    shown = json.loads(_run(url, "show", str(failed), "--json"))
    assert (shown["status"], shown["attempts"], shown["unique_key"]) == ("failed", 1, None)
    assert "card 2 declined" in shown["traceback_excerpt"] and "payload" not in shown
    assert json.loads(shown["payload_json"]) == {"n": 2} and shown["upstream"] == []
    assert "traceback:" in _run(url, "show", str(failed))
    assert (
        "no task 999999"
        in CliRunner().invoke(main, ["tasks", "show", "999999", "--dsn", url]).output
    )

    queues = {q["queue"]: q for q in _json(url, "queues")}
    assert (queues["later"]["queued"], queues["later"]["paused"]) == (2, False)
    assert "paused queue later" in _run(url, "pause", "later")
    assert "was paused already" in _run(url, "pause", "later")
    assert {q["queue"]: q["paused"] for q in _json(url, "queues")}["later"] is True
    assert "queue later is paused" in _run(url, "list")
    assert "resumed queue later" in _run(url, "resume", "later")
    assert "was not paused" in _run(url, "resume", "later")

    # The keyed failed task is skipped: a live task holds its unique_key (replaying it
    # would break the unique index); the other runs again from its first attempt.
    replayed = _run(url, "replay", "--all")
    assert "replayed 1 task(s)" in replayed and f"skipped task {keyed}" in replayed
    assert _states(url)[failed] == (0, 0) and _states(url)[keyed] == (3, 1)

    assert "cancelled 2 task(s)" in _run(url, "cancel", str(pending), str(failed), str(done))
    assert _states(url)[pending][0] == _states(url)[failed][0] == 4
    assert "discarded 1 task(s)" in _run(url, "discard", str(keyed), str(live))
    assert keyed not in _states(url) and live in _states(url)  # a live task is not discarded
    assert "purged 0 finished task(s)" in _run(url, "purge", "--older-than", "1h")
    assert "purged 3 finished task(s)" in _run(url, "purge", "--older-than", "0s")
    assert set(_states(url)) == {live}


async def test_the_workers_task_gauges_read_a_mariadb_task_table(url: str) -> None:
    failed = _enqueue(url, "boom", 1)
    await _settle(url, [failed])
    _enqueue(url, "square", 2, queue="later")
    _enqueue(url, "square", 3, queue="later", delay=3600)
    assert tasks.pause(url, "later")
    rows, queues = _TableGauges(url, "outboxkit_tasks", 10).read()
    by_name = {name: rest for name, *rest in rows}
    assert by_name["boom"][:4] == [0, 0, 0, 1]
    assert by_name["square"][:4] == [1, 1, 0, 0] and by_name["square"][4] >= 0
    assert queues == [("later", True)]
    rows, _ = _TableGauges(url, "outboxkit_tasks", 1).read()  # one name; the rest summed
    assert sorted(r[0] for r in rows) == ["(other)", "square"]  # square has the most
