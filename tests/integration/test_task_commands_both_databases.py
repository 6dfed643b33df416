"""`outboxkit tasks …` on a mysql:// DSN and a postgresql:// one alike, through the backend's
TaskAdmin: real rows made by real enqueues and a real Worker (failed tasks, a done one kept,
pending ones), each command's effect read back from the table, its --json parsed (the same
keys in the same order on both databases); and the worker's task gauges from the table."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pymysql
import pytest
from click.testing import CliRunner

from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.ops.cli import main
from outboxkit.ops.task_metrics import _TableGauges
from outboxkit.tasks import Tasks, Worker
from tests.support.mariadb_ops import task_database

tasks = Tasks()


@tasks.handler("square")
async def square(payload: dict[str, int]) -> int:
    return payload["n"] ** 2


@tasks.handler("boom", max_attempts=1)
async def boom(payload: dict[str, int]) -> None:
    raise ValueError(f"card {payload['n']} declined")


#: The keys of `tasks list --json` and `tasks show --json`, in order, on either database.
LISTED = ["id", "task_name", "queue", "status", "attempts", "priority", "key", "available_at",
          "created_at", "error_type", "last_error", "claimed_by", "due"]  # fmt: skip
SHOWN = ["id", "task_name", "queue", "priority", "key", "unique_key", "status", "attempts",
         "max_attempts", "available_at", "claim_token", "claimed_by", "last_error",
         "error_type", "traceback_excerpt", "created_at", "started_at", "finished_at",
         "lapses", "spared", "result", "progress", "keep_until", "has_dependents",
         "after_failure", "trace", "payload_json", "upstream", "downstream"]  # fmt: skip


@pytest.fixture(params=["mariadb", "postgresql"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A task table on the private mariadbd, and (the same commands' output) PostgreSQL's."""
    yield task_database(request)


def _connect(url: str) -> Any:
    if url.startswith("postgresql"):
        return psycopg.connect(url)
    conn = pymysql.connect(**connect_args(url))
    conn.begin()
    return conn


def _enqueue(url: str, name: str, n: int, **options: Any) -> int:
    conn = _connect(url)
    try:
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
    """Each task's (status, attempts), read from the table."""
    conn = _connect(url)
    try:
        cur = conn.cursor()
        cur.execute("SELECT id, status, attempts FROM outboxkit_tasks")
        return {int(i): (int(s), int(a)) for i, s, a in cur.fetchall()}
    finally:
        conn.close()


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


async def test_every_task_command_reads_and_acts_on_the_task_table_alike_on_both_databases(
    url: str,
) -> None:
    done = _enqueue(url, "square", 3)
    keyed = _enqueue(url, "boom", 1, unique_key="order-1")
    failed = _enqueue(url, "boom", 2)
    await _settle(url, [done, keyed, failed])
    live = _enqueue(url, "square", 4, queue="later", unique_key="order-1")  # holds the key
    pending = _enqueue(url, "square", 5, queue="later")

    listed = {r["id"]: r for r in _json(url, "list")}
    assert list(listed[done]) == LISTED
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
    assert list(shown) == SHOWN
    assert (shown["status"], shown["attempts"], shown["unique_key"]) == ("failed", 1, None)
    assert "card 2 declined" in shown["traceback_excerpt"] and "payload" not in shown
    assert json.loads(shown["payload_json"]) == {"n": 2} and shown["upstream"] == []
    assert "traceback:" in _run(url, "show", str(failed))
    assert (
        "no task 999999"
        in CliRunner().invoke(main, ["tasks", "show", "999999", "--dsn", url]).output
    )

    assert _json(url, "queues") == [
        {"queue": "later", "paused": False, "changed_at": None, "changed_by": None,
         "queued": 2, "running": 0}
    ]  # fmt: skip
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
    assert "replayed 1 task(s)" in _run(url, "replay", str(pending))  # by id: back to pending
    assert _states(url)[pending] == (0, 0)
    assert "discarded 1 task(s)" in _run(url, "discard", str(keyed), str(live))
    assert keyed not in _states(url) and live in _states(url)  # a live task is not discarded
    assert "purged 0 finished task(s)" in _run(url, "purge", "--older-than", "1h")
    assert "purged 2 finished task(s)" in _run(url, "purge", "--older-than", "0s")
    assert set(_states(url)) == {live, pending}


async def test_the_workers_task_gauges_read_the_task_table_of_either_database(url: str) -> None:
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
