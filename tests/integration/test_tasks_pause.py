"""Pausing a queue (issue 35, item 4): every worker stops claiming from it at its next claim,
running tasks finish, enqueue goes on; resume wakes the waiting workers at once (LISTEN),
not at their next poll. On real PostgreSQL, two workers, a poll of 30 s."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator

import psycopg
import pytest
from click.testing import CliRunner

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.ops.cli.app import main
from outboxkit.ops.task_metrics import TaskMetrics
from outboxkit.tasks import Tasks, Worker


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    yield db_dsn


def _enqueue(tasks: Tasks, dsn: str, queue: str, count: int, seconds: float = 0.0) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for _ in range(count):
            tasks.enqueue(conn, "job", {"queue": queue, "seconds": seconds}, queue=queue)


def _cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


async def _until(check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_paused_queue_is_claimed_by_no_worker_and_resume_wakes_them_at_once(
    tasks_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    tasks = Tasks()
    started: list[str] = []
    finished: list[str] = []

    @tasks.handler("job")
    async def job(payload: dict[str, object]) -> None:
        started.append(str(payload["queue"]))
        await asyncio.sleep(float(payload["seconds"]))  # type: ignore[arg-type]
        finished.append(str(payload["queue"]))

    out = _cli("tasks", "pause", "a", "--dsn", tasks_dsn)
    assert "paused queue a" in out
    assert "paused already" in _cli("tasks", "pause", "a", "--dsn", tasks_dsn)
    _enqueue(tasks, tasks_dsn, "a", 5)
    _enqueue(tasks, tasks_dsn, "b", 1, seconds=1.0)  # running when b is paused

    async def run() -> None:
        workers = [
            Worker(tasks, tasks_dsn, queues=["a", "b"], poll_interval=30.0) for _ in range(2)
        ]
        runs = [asyncio.create_task(w.run()) for w in workers]
        try:
            await _until(lambda: started == ["b"], 10)
            assert tasks.pause(tasks_dsn, "b")  # b has a task running: it finishes
            _enqueue(tasks, tasks_dsn, "b", 3)  # the NOTIFY wakes the workers: they pass
            await _until(lambda: finished == ["b"], 10)  # the running one finishes
            await asyncio.sleep(1.0)
            assert started == ["b"], "a paused queue's task was claimed"
            t0 = time.monotonic()
            assert tasks.resume(tasks_dsn, "a")
            await _until(lambda: started.count("a") == 5, 10)
            assert time.monotonic() - t0 < 5, "resume waited for the poll"  # (poll: 30 s)
            assert started.count("b") == 1
        finally:
            for w in workers:
                w.stop()
            await asyncio.gather(*runs)

    with caplog.at_level(logging.WARNING, logger="outboxkit.worker"):
        asyncio.run(run())
    assert any("queue(s) a paused" in r.getMessage() for r in caplog.records)

    states = [json.loads(line) for line in _cli("tasks", "queues", "--dsn", tasks_dsn, "--json")
              .splitlines()]  # fmt: skip
    by_queue = {s["queue"]: s for s in states}
    assert by_queue["a"]["paused"] is False and by_queue["b"]["paused"] is True
    assert by_queue["b"]["queued"] == 3 and by_queue["b"]["changed_by"].startswith("Tasks.pause")
    listing = _cli("tasks", "list", "--dsn", tasks_dsn)
    assert "queue b is paused" in listing and "queue a is paused" not in listing

    metrics = TaskMetrics(tasks_dsn, "outboxkit_tasks")
    text = asyncio.run(metrics.render()).decode()
    assert 'outboxkit_task_queue_paused{queue="b"} 1.0' in text
    assert 'outboxkit_task_queue_paused{queue="a"} 0.0' in text
    assert "resumed queue b" in _cli("tasks", "resume", "b", "--dsn", tasks_dsn)
    assert "was not paused" in _cli("tasks", "resume", "b", "--dsn", tasks_dsn)


def test_a_worker_on_a_table_before_version_3_says_to_migrate(tasks_dsn: str) -> None:
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE outboxkit_tasks_queues")
    tasks = Tasks()
    tasks.handler("job")(lambda payload: None)
    worker = Worker(tasks, tasks_dsn)
    with pytest.raises(Exception, match=r"older than this outboxkit.*outboxkit migrate --tasks"):
        asyncio.run(worker.run())
