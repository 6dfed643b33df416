"""Task mode end to end on real PostgreSQL: enqueue in the caller's transaction, the worker
(the queue core's loop with a handler sink) runs sync and async handlers, retries, snoozes,
fails with a traceback, keeps long tasks alive with its heartbeat."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pydantic
import pytest

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.errors import NotInTransactionError
from outboxkit.queue.tasks import TaskStatus
from outboxkit.tasks import Fail, InvalidTaskError, Retry, Snooze, TaskContext, Tasks, Worker

TABLE = "outboxkit_tasks"


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    yield db_dsn


class Report(pydantic.BaseModel):
    report_id: int
    kind: str = "daily"


@dataclasses.dataclass
class Mail:
    to: str


def run_worker(
    tasks: Tasks, dsn: str, until: Callable[[], bool], *, timeout: float = 10.0, **options: Any
) -> Worker:
    """Run a worker until ``until()`` holds (checked every 10 ms), then stop it."""
    options.setdefault("poll_interval", 0.05)
    worker = Worker(tasks, dsn, **options)

    async def main() -> None:
        task = asyncio.create_task(worker.run())
        deadline = time.monotonic() + timeout
        while not until():
            if task.done() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        worker.stop()
        await task

    asyncio.run(main())
    assert until(), "the worker did not get there in time"
    return worker


def rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            f"SELECT task_name, status, attempts, last_error, error_type, traceback_excerpt"
            f" FROM {TABLE} ORDER BY id"
        ).fetchall()


def test_tasks_of_several_types_reach_their_sync_and_async_handlers_decoded(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    seen: list[tuple[str, Any, int]] = []

    @tasks.handler("report.generate")
    async def generate(payload: Report, ctx: TaskContext) -> None:
        seen.append(("report", payload, ctx.attempt))

    @tasks.handler("mail.send")
    def send(payload: Mail) -> None:
        assert threading.current_thread() is not threading.main_thread()
        seen.append(("mail", payload, 1))

    @tasks.handler("plain")
    def plain(payload: dict[str, int]) -> None:
        seen.append(("plain", payload, 1))

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        assert tasks.enqueue(conn, "report.generate", Report(report_id=7))
        assert tasks.enqueue(conn, "mail.send", {"to": "a@example.com"})
        assert tasks.enqueue(conn, "plain", {"n": 1})
    run_worker(tasks, tasks_dsn, lambda: len(seen) == 3)
    assert sorted(seen, key=lambda s: s[0]) == [
        ("mail", Mail(to="a@example.com"), 1),
        ("plain", {"n": 1}, 1),
        ("report", Report(report_id=7, kind="daily"), 1),
    ]
    assert rows(tasks_dsn) == []  # finished tasks are deleted


def test_a_bad_payload_or_name_is_refused_at_enqueue_and_the_transaction_goes_on(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()

    @tasks.handler("report.generate")
    def generate(payload: Report) -> None: ...

    with psycopg.connect(tasks_dsn) as conn:
        with conn.transaction():
            with pytest.raises(InvalidTaskError, match="report_id"):
                tasks.enqueue(conn, "report.generate", {"kind": "x"})
            with pytest.raises(InvalidTaskError, match="no handler is registered"):
                tasks.enqueue(conn, "nope", {})
            assert tasks.enqueue(conn, "report.generate", {"report_id": 1})
        with pytest.raises(NotInTransactionError):
            conn.autocommit = True
            tasks.enqueue(conn, "report.generate", {"report_id": 2})
    assert [r[0] for r in rows(tasks_dsn)] == ["report.generate"]


def test_a_failing_handler_is_retried_on_its_schedule_then_failed_with_its_traceback(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    runs: list[float] = []

    @tasks.handler("flaky", retry=[0.2, 0.4], max_attempts=3)
    def flaky(payload: None) -> None:
        runs.append(time.monotonic())
        raise ValueError("the printer is on fire")

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "flaky")
    run_worker(tasks, tasks_dsn, lambda: rows(tasks_dsn)[0][1] == TaskStatus.FAILED)
    assert len(runs) == 3
    gaps = [b - a for a, b in itertools.pairwise(runs)]
    assert 0.2 <= gaps[0] < 0.2 + 0.5 and 0.4 <= gaps[1] < 0.4 + 0.5, gaps
    ((_name, _status, attempts, error, error_type, tb),) = rows(tasks_dsn)
    assert (attempts, error, error_type) == (3, "ValueError: the printer is on fire", "ValueError")
    assert "Traceback" in tb and "in flaky" in tb and "the printer is on fire" in tb


def test_snooze_spends_no_attempt_retry_counts_one_and_fail_ends_it_at_once(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    calls: dict[str, int] = {"snooze": 0, "retry": 0, "fail": 0}

    @tasks.handler("snooze", max_attempts=2)
    async def snoozy(payload: None) -> None:
        calls["snooze"] += 1
        if calls["snooze"] <= 3:
            raise Snooze(0.05)

    @tasks.handler("retry", max_attempts=5)
    def again(payload: None) -> None:
        calls["retry"] += 1
        if calls["retry"] == 1:
            raise Retry(0.05, "not yet")

    @tasks.handler("fail", max_attempts=5)
    def doomed(payload: None) -> None:
        calls["fail"] += 1
        raise Fail("the report was deleted")

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for name in calls:
            tasks.enqueue(conn, name)
    run_worker(
        tasks,
        tasks_dsn,
        lambda: rows(tasks_dsn) == [rows(tasks_dsn)[0]] if rows(tasks_dsn) else False,
    )
    assert calls == {"snooze": 4, "retry": 2, "fail": 1}  # 3 snoozes within max_attempts=2
    ((name, status, attempts, error, error_type, _tb),) = rows(tasks_dsn)
    assert (name, status, attempts, error, error_type) == (
        "fail",
        TaskStatus.FAILED,
        1,
        "the report was deleted",
        "Fail",
    )


def test_an_unknown_task_name_is_left_for_a_worker_that_has_it(tasks_dsn: str) -> None:
    """A worker claims only the names it has handlers for (a rolling deploy: the new
    name's tasks wait for the new workers; they used to be dead-lettered at once)."""
    writer = Tasks()

    @writer.handler("gone")
    def gone(payload: None) -> None: ...

    @writer.handler("here")
    def here(payload: None) -> None: ...

    ran: list[str] = []
    worker_tasks = Tasks()
    worker_tasks.handler("here")(lambda payload: ran.append("here"))
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        writer.enqueue(conn, "gone")
        writer.enqueue(conn, "here")
    run_worker(worker_tasks, tasks_dsn, lambda: ran == ["here"] and len(rows(tasks_dsn)) == 1)
    ((name, status, attempts, error, _type, _tb),) = rows(tasks_dsn)
    assert (name, status, attempts, error) == ("gone", TaskStatus.PENDING, 0, None)


def test_a_heartbeat_keeps_a_task_running_three_leases_alive_and_it_runs_once(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    runs: list[int] = []

    @tasks.handler("long")
    def long(payload: None, ctx: TaskContext) -> None:
        runs.append(ctx.attempt)
        end = time.monotonic() + 6.0  # CPU-bound, 3 x the lease
        while time.monotonic() < end:
            sum(range(1000))

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "long")
    # Two workers: the second would take the task if its lease ran out. The lease is 2 s,
    # not 1: a heartbeat every lease/3 then survives a 1.3 s stall of the worker's event
    # loop (a loaded 2-core CI machine stalled one by more than 0.6 s and lost a 1 s lease).
    done = threading.Event()
    other = threading.Thread(
        target=run_worker, args=(tasks, tasks_dsn, done.is_set),
        kwargs={"lease": 2.0, "timeout": 20.0},
    )  # fmt: skip
    other.start()
    try:
        run_worker(tasks, tasks_dsn, lambda: len(runs) == 1 and rows(tasks_dsn) == [],
                   lease=2.0, timeout=20.0)  # fmt: skip
        time.sleep(0.3)
    finally:
        done.set()
        other.join()
    assert runs == [1]


def test_a_timeout_counts_as_a_failed_attempt(tasks_dsn: str) -> None:
    tasks = Tasks()

    @tasks.handler("stuck", timeout=0.1, max_attempts=1)
    async def stuck(payload: None) -> None:
        await asyncio.sleep(10)

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "stuck")
    run_worker(tasks, tasks_dsn, lambda: rows(tasks_dsn)[0][1] == TaskStatus.FAILED)
    ((_n, _s, attempts, error, error_type, _tb),) = rows(tasks_dsn)
    assert (attempts, error_type) == (1, "Timeout")
    assert "timeout of 0.1s" in error


def test_tasks_of_one_key_run_one_at_a_time_in_enqueue_order_under_three_workers(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    lock = threading.Lock()
    running: dict[str, int] = {}
    order: dict[str, list[int]] = {"a": [], "b": []}
    overlaps: list[str] = []

    @tasks.handler("step")
    async def step(payload: dict[str, Any]) -> None:
        key = payload["key"]
        with lock:
            running[key] = running.get(key, 0) + 1
            if running[key] > 1:
                overlaps.append(key)
            order[key].append(payload["n"])
        await asyncio.sleep(0.01)
        with lock:
            running[key] -= 1

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for n in range(15):
            for key in ("a", "b"):
                tasks.enqueue(conn, "step", {"key": key, "n": n}, key=key)
    done = threading.Event()
    others = [
        threading.Thread(
            target=run_worker, args=(tasks, tasks_dsn, done.is_set), kwargs={"concurrency": 4}
        )
        for _ in range(2)
    ]
    for t in others:
        t.start()
    try:
        run_worker(tasks, tasks_dsn, lambda: len(order["a"]) + len(order["b"]) == 30,
                   concurrency=4)  # fmt: skip
    finally:
        done.set()
        for t in others:
            t.join()
    assert overlaps == []
    assert order == {"a": list(range(15)), "b": list(range(15))}


def test_a_delayed_task_never_runs_early_and_higher_priorities_run_first(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    started: list[tuple[str, float]] = []

    @tasks.handler("t")
    def record(payload: str) -> None:
        started.append((payload, time.time()))

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        enqueued = time.time()
        tasks.enqueue(conn, "t", "delayed", delay=0.5, priority=100)
        for p in (1, 5, 3):
            tasks.enqueue(conn, "t", f"p{p}", priority=p)
    run_worker(tasks, tasks_dsn, lambda: len(started) == 4, concurrency=1)
    assert [name for name, _ in started] == ["p5", "p3", "p1", "delayed"]
    assert started[-1][1] - enqueued >= 0.5


def test_a_running_task_cancelled_by_an_operator_sees_it_and_stays_cancelled(
    tasks_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    from outboxkit.backends.postgres.tasks_pg import cancel_tasks

    tasks = Tasks()
    seen: list[str] = []

    @tasks.handler("long")
    async def long(payload: None, ctx: TaskContext) -> None:
        seen.append("started")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "long")

    def cancelled() -> bool:
        if seen == ["started"] and rows(tasks_dsn)[0][1] == TaskStatus.RUNNING:
            cancel_tasks(tasks_dsn, TABLE, [1])
        return seen == ["started", "cancelled"]

    worker = run_worker(tasks, tasks_dsn, cancelled, lease=0.6)
    assert rows(tasks_dsn)[0][1] == TaskStatus.CANCELLED
    assert worker.stats.lost_leases == 1
    # The worker's own words, not the relay's ("re-claimed by another relay ... published")
    said = " ".join(r.getMessage() for r in caplog.records if "lease_lost" in r.getMessage())
    assert "1 of 1 task(s) were cancelled, or re-claimed by another worker" in said
    assert "relay" not in said and "publish" not in said


def test_a_failed_task_replayed_runs_again_from_its_first_attempt(tasks_dsn: str) -> None:
    from outboxkit.backends.postgres.tasks_pg import replay_tasks

    tasks = Tasks()
    attempts: list[int] = []
    fixed = threading.Event()

    @tasks.handler("fragile", max_attempts=1)
    def fragile(payload: None, ctx: TaskContext) -> None:
        attempts.append(ctx.attempt)
        if not fixed.is_set():
            raise RuntimeError("the bug")

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "fragile")
    run_worker(tasks, tasks_dsn, lambda: rows(tasks_dsn)[0][1] == TaskStatus.FAILED)
    fixed.set()
    assert replay_tasks(tasks_dsn, TABLE, [1]) == [1]
    run_worker(tasks, tasks_dsn, lambda: rows(tasks_dsn) == [])
    assert attempts == [1, 1]


def test_cancelling_one_task_of_a_claim_leaves_its_claim_mates_running(tasks_dsn: str) -> None:
    from outboxkit.backends.postgres.tasks_pg import cancel_tasks

    tasks = Tasks()
    seen: dict[int, str] = {}

    @tasks.handler("long")
    async def long(payload: None, ctx: TaskContext) -> None:
        seen[ctx.id] = "started"
        try:
            await asyncio.sleep(1.5)
        except asyncio.CancelledError:
            seen[ctx.id] = "cancelled"
            raise
        seen[ctx.id] = "finished"

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "long")
        tasks.enqueue(conn, "long")  # claimed with the first, in one statement

    def done() -> bool:
        if seen == {1: "started", 2: "started"} and rows(tasks_dsn)[0][1] == TaskStatus.RUNNING:
            cancel_tasks(tasks_dsn, TABLE, [1])
            seen[0] = "cancel sent"
        return seen.get(1) == "cancelled" and seen.get(2) == "finished"

    run_worker(tasks, tasks_dsn, done, lease=0.6, concurrency=2)
    assert [r[1] for r in rows(tasks_dsn)] == [TaskStatus.CANCELLED]


def test_a_queue_limit_caps_its_tasks_at_once_and_the_other_queues_go_on(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    running: dict[str, int] = {"slow": 0, "fast": 0}
    most: dict[str, int] = {"slow": 0, "fast": 0}
    finished: list[str] = []

    @tasks.handler("work")
    async def work(payload: str) -> None:
        running[payload] += 1
        most[payload] = max(most[payload], running[payload])
        await asyncio.sleep(0.05)
        running[payload] -= 1
        finished.append(payload)

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for _ in range(8):
            tasks.enqueue(conn, "work", "slow", queue="slow")
            tasks.enqueue(conn, "work", "fast", queue="fast")
    worker = run_worker(
        tasks,
        tasks_dsn,
        lambda: len(finished) == 16,
        queues=["slow", "fast"],
        queue_limits={"slow": 2},
        concurrency=8,
        poll_interval=5.0,  # a freed slot of the limited queue is claimed at once, not polled
    )
    assert worker.stats.done == 16
    assert most["slow"] == 2
    assert most["fast"] > 2
    with pytest.raises(ValueError, match="queue limit"):
        Worker(tasks, tasks_dsn, queues=["a"], queue_limits={"b": 1})


def test_a_task_prefetched_behind_a_slow_one_stays_leased_by_its_claims_heartbeat(
    tasks_dsn: str,
) -> None:
    """One heartbeat per claim covers its queued tasks too. A ran fast, so the prefetch
    expects short tasks and claims B and C together; B runs 2.5 leases. Without the claim's
    heartbeat C's lease lapses while it waits behind B (another worker would run it too)."""
    tasks = Tasks()
    started: dict[str, float] = {}

    @tasks.handler("step")
    async def step(payload: str) -> None:
        started[payload] = time.monotonic()
        if payload == "B":
            await asyncio.sleep(2.5)

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for name in "ABC":
            tasks.enqueue(conn, "step", name)
    leased: list[bool] = []

    def check() -> bool:
        b = started.get("B")
        if b is not None and "C" not in started and time.monotonic() - b > 1.8 and not leased:
            with psycopg.connect(tasks_dsn) as conn:
                row = conn.execute(
                    f"SELECT status = %s AND available_at > now() FROM {TABLE} WHERE id = 3",
                    (int(TaskStatus.RUNNING),),
                ).fetchone()
                leased.append(bool(row and row[0]))
        return "C" in started and rows(tasks_dsn) == []

    run_worker(tasks, tasks_dsn, check, lease=1.0, concurrency=1, prefetch=5)
    assert leased == [True]  # still this worker's, 1.8 leases after its claim
    assert list(started) == ["A", "B", "C"]
