"""Task ids, typed enqueue, results, progress and waiting on real PostgreSQL (issue: task mode
round 3). The value a handler returns is stored by its fenced completion; a zombie attempt's
result and progress are never stored; ``wait`` is woken by the completion, not a poll."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import decimal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pydantic
import pytest

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.tasks_pg import PgTaskStore
from outboxkit.errors import TaskNotFound
from outboxkit.queue.store import DONE
from outboxkit.queue.tasks import TaskClaim
from outboxkit.tasks import Fail, TaskContext, Tasks, Worker
from outboxkit.tasks.results import MAX_RESULT_BYTES
from tests.integration.test_tasks_worker import run_worker

TABLE = "outboxkit_tasks"


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    yield db_dsn


class Report(pydantic.BaseModel):
    report_id: int
    total: decimal.Decimal
    at: dt.datetime


@dataclasses.dataclass
class Point:
    x: int
    tag: uuid.UUID


def _enqueue(tasks: Tasks, dsn: str, name: str, payload: Any = None, **options: Any) -> int:
    with psycopg.connect(dsn) as conn, conn.transaction():
        task_id = tasks.enqueue(conn, name, payload, **options)
    assert isinstance(task_id, int)
    return task_id


def test_enqueue_returns_ids_and_none_for_a_skipped_duplicate_on_every_path(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()

    @tasks.handler("job")
    def job(payload: dict[str, int]) -> None: ...

    with psycopg.connect(tasks_dsn) as conn:
        with conn.transaction():
            first = tasks.enqueue(conn, "job", {"n": 1}, unique_key="k")
            again = tasks.enqueue(conn, "job", {"n": 2}, unique_key="k")
            typed = job.enqueue(conn, {"n": 3})
        assert isinstance(first, int) and again is None
        assert isinstance(typed, int) and typed > first
        with tasks.transaction(conn) as tx:
            handles = [tx.enqueue("job", {"n": 4}), tx.enqueue("job", {"n": 5}, unique_key="k")]
            with pytest.raises(RuntimeError, match="known once its transaction has committed"):
                _ = handles[0].id
        assert isinstance(handles[0].id, int) and handles[0].id > typed
        assert handles[1].id is None  # the live task holds unique_key "k"
        with tasks.transaction(conn) as tx:  # the second commit runs the prepared INSERT
            later = tx.enqueue("job", {"n": 6})
        assert later.id is not None and later.id > handles[0].id

    async def async_paths() -> tuple[int | None, int | None]:
        async with await psycopg.AsyncConnection.connect(tasks_dsn) as aconn:
            async with aconn.transaction():
                plain = await job.aenqueue(aconn, {"n": 7})
            async with tasks.atransaction(aconn) as atx:
                handle = atx.enqueue("job", {"n": 8})
            return plain, handle.id

    plain, handled = asyncio.run(async_paths())
    assert plain is not None and handled is not None and handled > plain
    with psycopg.connect(tasks_dsn) as conn:
        ids = [r[0] for r in conn.execute(f"SELECT id FROM {TABLE} ORDER BY id")]
    assert ids == [first, typed, handles[0].id, later.id, plain, handled]


def test_results_of_sync_and_async_handlers_keep_every_payload_type(tasks_dsn: str) -> None:
    tasks = Tasks()
    at = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.UTC)
    tag = uuid.UUID(int=7)

    @tasks.handler("report", keep_result=True)
    async def report(payload: dict[str, int]) -> Report:
        return Report(report_id=payload["id"], total=decimal.Decimal("12.50"), at=at)

    @tasks.handler("point", keep_result=dt.timedelta(minutes=5))
    def point(payload: dict[str, int]) -> Point:
        assert threading.current_thread() is not threading.main_thread()
        return Point(x=payload["x"], tag=tag)

    @tasks.handler("many", keep_result=True)
    def many(payload: None, ctx: TaskContext) -> Any:
        ctx.progress(0.5)
        return {"n": [1, 2.5, None], "d": decimal.Decimal("1.10"), "when": at, "set": {3}}

    @tasks.handler("nothing", keep_result=True)
    async def nothing(payload: None) -> None:
        return None

    @tasks.handler("forgotten")
    def forgotten(payload: None) -> int:
        return 42

    ids = {
        "report": _enqueue(tasks, tasks_dsn, "report", {"id": 9}),
        "point": _enqueue(tasks, tasks_dsn, "point", {"x": 3}),
        "many": _enqueue(tasks, tasks_dsn, "many"),
        "nothing": _enqueue(tasks, tasks_dsn, "nothing"),
        "forgotten": _enqueue(tasks, tasks_dsn, "forgotten"),
    }

    def finished() -> bool:
        results = [tasks.result(tasks_dsn, i) for i in ids.values()]
        return all(r is None or r.finished for r in results)

    run_worker(tasks, tasks_dsn, finished)
    got = {name: tasks.result(tasks_dsn, i) for name, i in ids.items()}
    assert got["report"] is not None and got["report"].status == "done"
    assert got["report"].value == {"report_id": 9, "total": "12.50", "at": "2026-12-05T12:00:00Z"}
    assert Report.model_validate(got["report"].value).total == decimal.Decimal("12.50")
    assert got["point"] is not None and got["point"].value == {"x": 3, "tag": str(tag)}
    assert got["many"] is not None
    assert got["many"].value == {
        "n": [1, 2.5, None], "d": "1.10", "when": "2026-12-05T12:00:00+00:00", "set": [3],
    }  # fmt: skip
    assert got["nothing"] is not None and (got["nothing"].status, got["nothing"].value) == (
        "done",
        None,
    )
    assert got["forgotten"] is None  # no keep_result: a finished task leaves nothing
    r = got["report"]
    assert r.attempts == 1 and r.error is None and r.ok
    assert r.started_at is not None and r.finished_at is not None
    assert r.enqueued_at <= r.started_at <= r.finished_at


def test_a_result_that_cannot_be_stored_fails_the_attempt_with_a_clear_error(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()

    @tasks.handler("huge", keep_result=True, max_attempts=1)
    def huge(payload: None) -> str:
        return "x" * (MAX_RESULT_BYTES + 1)

    @tasks.handler("nan", keep_result=True, max_attempts=1)
    def nan(payload: None) -> float:
        return float("nan")

    @tasks.handler("opaque", keep_result=True, max_attempts=1)
    def opaque(payload: None) -> object:
        return object()

    ids = [_enqueue(tasks, tasks_dsn, n) for n in ("huge", "nan", "opaque")]

    def failed() -> bool:
        return all((r := tasks.result(tasks_dsn, i)) is not None and r.finished for i in ids)

    run_worker(tasks, tasks_dsn, failed)
    errors = [tasks.result(tasks_dsn, i) for i in ids]
    assert [e.status if e else None for e in errors] == ["failed"] * 3
    messages = [e.error.message if e and e.error else "" for e in errors]
    assert "over the 1048576 limit" in messages[0]
    assert "NaN" in messages[1] and "is not JSON" in messages[2]
    assert all(e and e.error and e.error.type == "ResultError" for e in errors)


def test_wait_is_woken_by_the_completion_within_milliseconds_not_at_a_poll(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()

    @tasks.handler("slow", keep_result=True)
    async def slow(payload: None) -> str:
        await asyncio.sleep(2.0)
        return "ready"

    task_id = _enqueue(tasks, tasks_dsn, "slow")
    waited: list[tuple[Any, float]] = []

    def waiter() -> None:
        with psycopg.connect(tasks_dsn, autocommit=True) as conn:
            result = tasks.wait(conn, task_id, timeout=20)
            waited.append((result, time.time()))

    thread = threading.Thread(target=waiter)
    thread.start()
    run_worker(tasks, tasks_dsn, lambda: bool(waited), timeout=20)
    thread.join(5)
    result, woke = waited[0]
    assert result.status == "done" and result.value == "ready"
    # Polling alone (backoff 50 ms doubling to 1 s) would look at 1.55 s and 2.55 s after
    # the start: a completion at about 2 s would be seen half a second late.
    late = woke - result.finished_at.timestamp()
    assert late < 0.2, f"woken {late:.3f} s after the completion"


def test_wait_and_await_result_report_failures_cancels_timeouts_and_unknown_ids(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()

    @tasks.handler("bad", keep_result=True)
    def bad(payload: None) -> None:
        raise Fail("the report does not exist")

    @tasks.handler("later", keep_result=True)
    def later(payload: None) -> None: ...

    failing = _enqueue(tasks, tasks_dsn, "bad")
    scheduled = _enqueue(tasks, tasks_dsn, "later", delay=3600)
    run_worker(tasks, tasks_dsn, lambda: tasks.result(tasks_dsn, failing).status == "failed")  # type: ignore[union-attr]
    failed = tasks.wait(tasks_dsn, failing, timeout=5)
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.type == "Fail" and "does not exist" in (failed.error.message or "")
    with pytest.raises(TimeoutError, match=rf"task {scheduled} \(later\) .* scheduled"):
        tasks.wait(tasks_dsn, scheduled, timeout=0.3)
    with pytest.raises(TaskNotFound, match="keep_result=True"):
        tasks.wait(tasks_dsn, 10**9, timeout=1)
    with psycopg.connect(tasks_dsn) as conn, pytest.raises(TypeError, match="autocommit"):
        tasks.wait(conn, scheduled, timeout=1)

    async def cancel_while_awaiting() -> Any:
        from outboxkit.backends.postgres.tasks_pg import cancel_tasks

        waiting = asyncio.create_task(tasks.await_result(tasks_dsn, scheduled, timeout=10))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await asyncio.to_thread(cancel_tasks, tasks_dsn, TABLE, [scheduled])
        result = await waiting
        return result, time.monotonic() - started

    cancelled, took = asyncio.run(cancel_while_awaiting())
    assert cancelled.status == "cancelled" and took < 0.5


def test_a_zombies_result_and_progress_are_never_stored(tasks_dsn: str) -> None:
    tasks = Tasks()

    @tasks.handler("job", keep_result=True)
    def job(payload: None, ctx: TaskContext) -> None: ...

    task_id = _enqueue(tasks, tasks_dsn, "job")

    async def run() -> None:
        store = PgTaskStore(tasks_dsn, TABLE)
        try:
            what = TaskClaim("default")
            zombie = (await store.claim_tasks(what, limit=1, lease=0.2, token=uuid.uuid4(),
                                              owner="a", max_attempts=5)).claim  # fmt: skip
            assert zombie is not None
            await asyncio.sleep(0.3)  # frozen past its lease: another worker claims the task
            live = (await store.claim_tasks(what, limit=1, lease=30, token=uuid.uuid4(),
                                            owner="b", max_attempts=5)).claim  # fmt: skip
            assert live is not None
            await store.progress([(task_id, live.token, '{"step": "live"}')])
            await store.progress([(task_id, zombie.token, '{"step": "zombie"}')])
            live.items[0].keep, live.items[0].result = 60.0, '"live"'
            assert list((await store.settle(live, [DONE])).ids) == [task_id]
            zombie.items[0].keep, zombie.items[0].result = 60.0, '"zombie"'
            assert list((await store.settle(zombie, [DONE])).ids) == []
        finally:
            await store.close()

    asyncio.run(run())
    result = tasks.result(tasks_dsn, task_id)
    assert result is not None and (result.value, result.progress) == ("live", {"step": "live"})


def test_progress_is_throttled_and_a_result_of_a_transaction_completed_task_follows(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    writes: list[Any] = []

    @tasks.handler("steps", keep_result=True)
    def steps(payload: None, ctx: TaskContext) -> dict[str, int]:
        for n in range(200):  # a tight loop: written about once a second, not 200 times
            ctx.progress({"done": n + 1, "of": 200})
            time.sleep(0.01)
        with pytest.raises(ValueError, match="from 0 to 1"):
            ctx.progress(1.5)
        with ctx.transaction() as conn:
            conn.execute("SELECT 1")
        return {"steps": 200}

    task_id = _enqueue(tasks, tasks_dsn, "steps")

    def watch() -> bool:
        result = tasks.result(tasks_dsn, task_id)
        if result is not None and result.progress not in (None, *writes):
            writes.append(result.progress)
        return result is not None and result.value is not None

    worker = run_worker(tasks, tasks_dsn, watch, timeout=20)
    assert isinstance(worker, Worker)
    final = tasks.result(tasks_dsn, task_id)
    assert final is not None and final.value == {"steps": 200} and final.status == "done"
    assert final.progress == {"done": 200, "of": 200}
    assert 1 <= len(writes) <= 6, writes  # ~2 s of reports, one write a second at most
