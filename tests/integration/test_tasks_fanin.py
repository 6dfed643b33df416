"""Dependencies and fan-in on real PostgreSQL with real worker processes: a callback waiting for
200 children runs once, after the last of them, with workers SIGKILLed while children
complete; a failed child cancels its dependent with the reason; a zombie parent spawns no
children; the claim stays O(batch) with 100 000 dependents waiting."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outboxkit import Outbox
from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.tasks_pg import PgTaskStore
from outboxkit.backends.postgres.tasks_sql import TaskStatements
from outboxkit.errors import InvalidTaskError
from outboxkit.queue.tasks import TaskClaim
from outboxkit.tasks import Fail, LeaseLost, TaskContext, Tasks
from tests.integration.test_tasks_processes import spawn_worker
from tests.integration.test_tasks_worker import run_worker
from tests.support.tasks_app import FANIN_DDL
from tests.support.tasks_app import tasks as app_tasks

TABLE = "outboxkit_tasks"


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(FANIN_DDL)
    yield db_dsn


def test_a_fan_in_of_200_children_runs_its_callback_once_after_the_last_despite_sigkills(
    tasks_dsn: str,
) -> None:
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        children = [
            app_tasks.enqueue(conn, "fanin.child", {"n": n, "sleep_ms": 150}) for n in range(200)
        ]
        callback = app_tasks.enqueue(conn, "fanin.callback", after=[c for c in children if c])
    assert callback is not None and all(children)
    args = ("--lease", "1", "--concurrency", "10")
    workers = [spawn_worker(tasks_dsn, *args) for _ in range(3)]
    kills = 0
    rng = random.Random(7)
    try:
        deadline = time.monotonic() + 90
        while kills < 10 and time.monotonic() < deadline:
            time.sleep(0.3)
            victim = rng.randrange(len(workers))
            workers[victim].send_signal(signal.SIGKILL)  # children die mid-run, mid-settle
            workers[victim].wait(10)
            workers[victim] = spawn_worker(tasks_dsn, *args)
            kills += 1
        result = app_tasks.wait(tasks_dsn, callback, timeout=90)
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(20)
            except subprocess.TimeoutExpired:
                w.kill()
    assert kills == 10
    assert result.status == "done" and result.value == sum(range(200))
    with psycopg.connect(tasks_dsn) as conn:
        runs = conn.execute(
            "SELECT attempt, seen, at FROM fanin_runs WHERE kind = 'callback'"
        ).fetchall()
        last_child = conn.execute(
            f"SELECT max(finished_at), count(*) FILTER (WHERE status = 2) FROM {TABLE}"
            " WHERE id = ANY(%s)",
            (children,),
        ).fetchone()
    assert last_child is not None and last_child[1] == 200  # every child done, kept
    assert len(runs) == 1, runs  # the callback's effect landed once
    assert runs[0][1] == 200  # and it saw every child's result
    assert runs[0][2] > last_child[0]  # after the last child completed


def test_a_failed_child_cancels_its_dependent_with_the_reason_or_it_runs_anyway(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    ran: list[list[str]] = []

    @tasks.handler("child")
    def child(payload: dict[str, bool]) -> None:
        if payload["fail"]:
            raise Fail("the source file is gone")

    @tasks.handler("callback")
    def callback(payload: None, ctx: TaskContext) -> None:
        ran.append([r.status for r in ctx.dependencies()])

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        good = tasks.enqueue(conn, "child", {"fail": False})
        bad = tasks.enqueue(conn, "child", {"fail": True})
        assert good is not None and bad is not None
        cancelled = tasks.enqueue(conn, "callback", after=[good, bad])
        anyway = tasks.enqueue(conn, "callback", after=[good, bad], after_failure="run")
        assert cancelled is not None and anyway is not None
        assert tasks.result(conn, cancelled).status == "waiting"  # type: ignore[union-attr]

    def settled() -> bool:  # (the one that runs keeps no result: done, it is deleted)
        got = [tasks.result(tasks_dsn, i) for i in (cancelled, anyway)]
        return all(r is None or r.finished for r in got) and bool(ran)

    run_worker(tasks, tasks_dsn, settled, timeout=20)
    gone = tasks.result(tasks_dsn, cancelled)
    assert gone is not None and gone.status == "cancelled" and gone.error is not None
    assert gone.error.type == "UpstreamFailed"
    assert f"upstream task {bad} failed" in (gone.error.message or "")
    assert ran == [["done", "failed"]]  # the one that runs anyway saw both


def test_after_refuses_unknown_ids_and_what_it_cannot_keep(tasks_dsn: str) -> None:
    tasks = Tasks()
    tasks.handler("job")(lambda payload: None)
    with psycopg.connect(tasks_dsn) as conn:
        with pytest.raises(InvalidTaskError, match=r"task\(s\) 999999 that do not exist"):
            with conn.transaction():
                tasks.enqueue(conn, "job", after=[999999])
        with conn.transaction():
            up = tasks.enqueue(conn, "job")
            assert up is not None
            with pytest.raises(InvalidTaskError, match="does not combine with key"):
                tasks.enqueue(conn, "job", after=[up], key="k")
            with pytest.raises(InvalidTaskError, match="after_failure"):
                tasks.enqueue(conn, "job", after=[up], after_failure="ignore")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not taken inside tasks.transaction"):
            with tasks.transaction(conn) as tx:
                tx.enqueue("job", after=[up])


def test_a_zombie_parent_spawns_no_children(tasks_dsn: str) -> None:
    tasks = Tasks()
    tasks.handler("parent")(lambda payload: None)
    tasks.handler("child")(lambda payload: None)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "parent")

    async def run() -> None:
        store = PgTaskStore(tasks_dsn, TABLE)
        try:
            what = TaskClaim("default")
            zombie = (await store.claim_tasks(what, limit=1, lease=0.2, token=uuid.uuid4(),
                                              owner="a", max_attempts=5)).claim  # fmt: skip
            assert zombie is not None
            await asyncio.sleep(0.3)  # frozen past its lease: another worker takes it
            live = (await store.claim_tasks(what, limit=1, lease=30, token=uuid.uuid4(),
                                            owner="b", max_attempts=5)).claim  # fmt: skip
            assert live is not None

            def spawn(claim: Any, n: int) -> None:
                ctx = TaskContext(claim.items[0], claim.token, store=store, outbox=Outbox(),
                                  worker_id="t")  # fmt: skip
                with ctx.transaction() as conn:
                    for i in range(n):
                        tasks.enqueue(conn, "child", {"i": i})

            with pytest.raises(LeaseLost):
                await asyncio.to_thread(spawn, zombie, 5)
            await asyncio.to_thread(spawn, live, 2)
        finally:
            await store.close()

    asyncio.run(run())
    with psycopg.connect(tasks_dsn) as conn:
        names = [r[0] for r in conn.execute(f"SELECT task_name FROM {TABLE} ORDER BY id")]
    assert names == ["child", "child"]  # the live attempt's two; the parent completed


def _claim_probe(dsn: str) -> tuple[int, int, int]:
    """The claim statement (EXPLAIN ANALYZE, rolled back): rows its walk of the claim index
    read, that walk's shared buffers, and the whole statement's."""
    sql = TaskStatements(TABLE)
    params = {"queue": "default", "alone": False, "limit": 10, "lease": 30.0,
              "token": uuid.uuid4(), "owner": "probe", "max_attempts": 5,
              "names": None, "name": None, "concurrency": None, "rate": None,
              "burst": 1, "skip": []}  # fmt: skip
    with psycopg.connect(dsn) as conn:
        plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.claim, params)
        row = plan.fetchone()
        conn.rollback()
    assert row is not None
    top = row[0][0]["Plan"]

    def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield node
        for child in node.get("Plans", []):
            yield from walk(child)

    scans = [n for n in walk(top) if n.get("Index Name") == f"{TABLE}_claim_idx"]
    assert len(scans) == 1
    scan = scans[0]
    return (
        int(scan["Actual Rows"]),
        int(scan["Shared Hit Blocks"]) + int(scan.get("Shared Read Blocks", 0)),
        int(top["Shared Hit Blocks"]) + int(top.get("Shared Read Blocks", 0)),
    )


def test_the_claim_stays_o_batch_with_100_000_dependents_waiting(tasks_dsn: str) -> None:
    tasks = Tasks()
    tasks.handler("job")(lambda payload: None)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for _ in range(20):
            tasks.enqueue(conn, "job")
    rows_before, walk_before, _total = _claim_probe(tasks_dsn)
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {TABLE} (task_name, queue, payload, status, after_failure)"
            " SELECT 'job', 'default', '{}', 5, 0 FROM generate_series(1, 100000)"
        )
        conn.execute(f"ANALYZE {TABLE}")
    rows_after, walk_after, total = _claim_probe(tasks_dsn)
    # The waiting tasks are outside the claim index: its walk reads the batch and stops,
    # the same pages as before; the whole statement stays a few pages per claimed task
    # (the primary key's depth for the update).
    assert rows_before == rows_after == 10
    assert walk_after == walk_before, (walk_before, walk_after)
    assert total < 20 * 10, total


def test_a_key_flooding_the_queue_costs_the_claim_nothing(tasks_dsn: str) -> None:
    tasks = Tasks()
    tasks.handler("job")(lambda payload: None)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for _ in range(20):
            tasks.enqueue(conn, "job", key="quiet")
    _rows, walk_before, _total = _claim_probe(tasks_dsn)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for _ in range(3000):  # one tenant floods its key
            tasks.enqueue(conn, "job", key="flood")
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute(f"ANALYZE {TABLE}")
        waiting = conn.execute(
            f"SELECT count(*) FROM {TABLE} WHERE key = 'flood' AND status = 5"
        ).fetchone()
    assert waiting == (2999,)  # behind its head, out of the claim index
    rows, walk_after, total_after = _claim_probe(tasks_dsn)
    assert rows == 2  # the two heads ('quiet' and 'flood'), in one claim
    assert walk_after <= walk_before + 2, (walk_before, walk_after)
    assert total_after < 20 * 10, total_after
