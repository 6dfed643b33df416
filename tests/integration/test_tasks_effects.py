"""Effects that happen once: ctx.transaction() fenced by the claim token, ctx.outbox, a task
and events in one transaction, unique_key under a concurrent rollback, the enqueue with the
COMMIT."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.tasks_pg import PgTaskStore
from outboxkit.queue.store import DONE
from outboxkit.queue.tasks import TaskClaim
from outboxkit.tasks import LeaseLost, TaskContext, Tasks, Worker

TABLE = "outboxkit_tasks"


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (task_id bigint, attempt int)")
    yield db_dsn


def count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        assert row is not None
        return int(row[0])


def make_tasks() -> Tasks:
    tasks = Tasks()
    tasks.handler("job")(lambda payload: None)
    return tasks


def test_a_zombie_attempts_transaction_is_rolled_back_and_its_late_settle_is_a_no_op(
    tasks_dsn: str,
) -> None:
    tasks = make_tasks()
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "job")
    outbox = Outbox()

    async def run() -> None:
        store = PgTaskStore(tasks_dsn, TABLE)
        try:
            token = uuid.uuid4()
            what = TaskClaim("default")
            zombie = (await store.claim_tasks(what, limit=1, lease=0.2, token=token, owner="a",
                                              max_attempts=5)).claim  # fmt: skip
            assert zombie is not None
            await asyncio.sleep(0.3)  # frozen: no heartbeat, the lease runs out
            token2 = uuid.uuid4()
            live = (await store.claim_tasks(what, limit=1, lease=30, token=token2, owner="b",
                                            max_attempts=5)).claim  # fmt: skip
            assert live is not None and live.ids == zombie.ids

            def effects(claim: Any, tok: uuid.UUID) -> None:
                ctx = TaskContext(claim.items[0], tok, store=store, outbox=outbox, worker_id="t")
                with ctx.transaction() as conn:
                    conn.execute("INSERT INTO effects VALUES (%s, %s)", (ctx.id, ctx.attempt))
                    ctx.outbox.put(Event(topic="t", event_type="job.done", payload=b"{}"))

            with pytest.raises(LeaseLost, match="re-claimed by another worker"):
                await asyncio.to_thread(effects, zombie, token)
            assert count(tasks_dsn, "effects") == 0 and count(tasks_dsn, "outbox") == 0
            await asyncio.to_thread(effects, live, token2)
            assert live.items[0].completed
            assert list((await store.settle(live, [DONE])).ids) == live.ids  # nothing left
            late = await store.settle(zombie, [DONE])
            assert (list(late.ids), late.lost) == ([], 1)
        finally:
            await store.close()

    asyncio.run(run())
    assert count(tasks_dsn, "effects") == 1 and count(tasks_dsn, "outbox") == 1
    assert count(tasks_dsn, TABLE) == 0


def test_a_handlers_transaction_and_event_commit_with_the_completion_in_the_worker(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()

    @tasks.handler("charge")
    async def charge(payload: dict[str, int], ctx: TaskContext) -> None:
        async with ctx.atransaction() as conn:
            await conn.execute("INSERT INTO effects VALUES (%s, %s)", (ctx.id, ctx.attempt))
            await ctx.outbox.aput(Event(topic="billing", event_type="charged", payload=b"{}"))

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "charge", {"amount": 5})
    worker = Worker(tasks, tasks_dsn, poll_interval=0.05)

    async def main() -> None:
        run = asyncio.create_task(worker.run())
        while count(tasks_dsn, TABLE):
            await asyncio.sleep(0.02)
        worker.stop()
        await run

    asyncio.run(main())
    assert count(tasks_dsn, "effects") == 1 and count(tasks_dsn, "outbox") == 1
    assert worker.stats.done == 1 and worker.stats.lost_leases == 0


def test_a_task_and_an_event_in_one_transaction_commit_or_roll_back_together(
    tasks_dsn: str,
) -> None:
    tasks, outbox = make_tasks(), Outbox()
    event = Event(topic="orders", event_type="order.placed", payload=b"{}")
    with psycopg.connect(tasks_dsn) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            outbox.put(conn, event)
            tasks.enqueue(conn, "job")
            raise RuntimeError("the order failed")
        assert (count(tasks_dsn, "outbox"), count(tasks_dsn, TABLE)) == (0, 0)
        with pytest.raises(RuntimeError), tasks.transaction(conn) as tx:
            outbox.put(conn, event)
            tx.enqueue("job")
            raise RuntimeError("the order failed")
        assert (count(tasks_dsn, "outbox"), count(tasks_dsn, TABLE)) == (0, 0)
        with conn.transaction():
            outbox.put(conn, event)
            tasks.enqueue(conn, "job")
        with tasks.transaction(conn) as tx:  # the INSERT travels with the COMMIT
            outbox.put(conn, event)
            tx.enqueue("job", delay=60, priority=3, key="k", unique_key="u")
    assert (count(tasks_dsn, "outbox"), count(tasks_dsn, TABLE)) == (2, 2)
    with psycopg.connect(tasks_dsn) as conn:
        row = conn.execute(
            f"SELECT priority, key, unique_key, available_at > now() + interval '50 s'"
            f" FROM {TABLE} ORDER BY id DESC LIMIT 1"
        ).fetchone()
    assert row == (3, "k", "u", True)


@pytest.mark.parametrize("first_commits", [False, True])
def test_unique_key_a_concurrent_enqueue_waits_and_survives_the_firsts_rollback(
    tasks_dsn: str, first_commits: bool
) -> None:
    tasks = make_tasks()
    second: list[int | None] = []
    with psycopg.connect(tasks_dsn) as first:
        first.execute("BEGIN")
        assert tasks.enqueue(first, "job", unique_key="report:7")

        def enqueue_again() -> None:
            with psycopg.connect(tasks_dsn) as conn, conn.transaction():
                second.append(tasks.enqueue(conn, "job", unique_key="report:7"))

        thread = threading.Thread(target=enqueue_again)
        thread.start()
        time.sleep(0.3)
        assert second == []  # waits for the first transaction
        if first_commits:
            first.commit()
        else:
            first.rollback()
        thread.join(10)
    # The second enqueue's id when the first rolled back; None (skipped) when it committed.
    assert (second[0] is None) == first_commits
    assert count(tasks_dsn, TABLE) == 1


def test_the_async_drivers_enqueue_too(tasks_dsn: str) -> None:
    import asyncpg

    tasks = make_tasks()

    async def run() -> None:
        conn = await asyncpg.connect(tasks_dsn)
        try:
            async with conn.transaction():
                assert await tasks.aenqueue(conn, "job", {"a": 1}, delay=0.5)
        finally:
            await conn.close()
        async with await psycopg.AsyncConnection.connect(tasks_dsn) as aconn:
            async with tasks.atransaction(aconn) as tx:
                tx.enqueue("job", {"b": 2})

    asyncio.run(run())
    assert count(tasks_dsn, TABLE) == 2


def test_a_second_enqueuer_of_a_key_waits_for_the_first_so_ids_follow_commit_order(
    tasks_dsn: str,
) -> None:
    tasks = make_tasks()
    second: list[int | None] = []
    with psycopg.connect(tasks_dsn) as first:
        first.execute("BEGIN")
        tasks.enqueue(first, "job", {"n": 1}, key="order:7")

        def enqueue_again() -> None:
            with psycopg.connect(tasks_dsn) as conn, conn.transaction():
                second.append(tasks.enqueue(conn, "job", {"n": 2}, key="order:7"))
                tasks.enqueue(conn, "job", {"n": 3}, key="order:8")

        thread = threading.Thread(target=enqueue_again)
        thread.start()
        time.sleep(0.3)
        # Without the key lock the second would commit first with the higher id, and the
        # first, committed later, would run beside it (nothing earlier of its key).
        assert second == []
        first.commit()
        thread.join(10)
    with psycopg.connect(tasks_dsn) as conn:
        ids = conn.execute(f"SELECT payload->>'n' FROM {TABLE} ORDER BY id").fetchall()
    assert [n for (n,) in ids] == ["1", "2", "3"]


def test_lifecycle_events_are_written_with_each_state_change(tasks_dsn: str) -> None:
    tasks = Tasks()
    calls = {"n": 0}

    @tasks.handler("flaky", events="task-events", retry=[0.05], max_attempts=2)
    def flaky(payload: None) -> None:
        calls["n"] += 1
        raise ValueError("nope")

    @tasks.handler("fine", events="task-events")
    async def fine(payload: None, ctx: TaskContext) -> None:
        async with ctx.atransaction() as conn:
            await conn.execute("INSERT INTO effects VALUES (%s, %s)", (ctx.id, ctx.attempt))

    @tasks.handler("quiet")
    def quiet(payload: None) -> None:
        pass

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        for name in ("flaky", "fine", "quiet"):
            tasks.enqueue(conn, name)
    worker = Worker(tasks, tasks_dsn, poll_interval=0.05)

    def remaining() -> list[str]:
        with psycopg.connect(tasks_dsn) as conn:
            return [r[0] for r in conn.execute(f"SELECT task_name FROM {TABLE} WHERE status <> 3")]

    async def main() -> None:
        run = asyncio.create_task(worker.run())
        deadline = time.monotonic() + 10
        while remaining() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        worker.stop()
        await run

    asyncio.run(main())
    with psycopg.connect(tasks_dsn) as conn:
        events = conn.execute(
            "SELECT event_type, payload::text FROM outbox WHERE topic = 'task-events' ORDER BY id"
        ).fetchall()
    import json

    seen = [(t, json.loads(bytes.fromhex(p[2:]))["task_name"]) for t, p in events]
    assert sorted(seen) == [
        ("task.completed", "fine"),
        ("task.dead_lettered", "flaky"),
        ("task.failed", "flaky"),
    ]


def test_the_crash_loop_guards_dead_letter_emits_its_lifecycle_event_in_the_claim(
    tasks_dsn: str,
) -> None:
    from outboxkit.tasks.lifecycle import LifecycleEvents

    tasks = Tasks()
    tasks.handler("poison", events="task-events", max_attempts=1)(lambda payload: None)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        task_id = tasks.enqueue(conn, "poison")
        # Its last claim ran it alone and its worker died (a suspect past max_attempts).
        conn.execute(
            f"UPDATE {TABLE} SET status = 1, attempts = 1, lapses = 2,"
            " available_at = now() - interval '1 s' WHERE id = %s",
            (task_id,),
        )

    async def run() -> Any:
        store = PgTaskStore(tasks_dsn, TABLE, on_settle=LifecycleEvents(tasks, Outbox()))
        try:
            what = TaskClaim("default", alone=True)
            return await store.claim_tasks(
                what, limit=1, lease=30, token=uuid.uuid4(), owner="t", max_attempts=1
            )
        finally:
            await store.close()

    got = asyncio.run(run())
    assert got.claim is not None and got.claim.ids == [] and len(got.claim.dead) == 1
    with psycopg.connect(tasks_dsn) as conn:
        state = conn.execute(f"SELECT status, error_type FROM {TABLE}").fetchall()
        events = conn.execute(
            "SELECT event_type, payload FROM outbox WHERE topic = 'task-events'"
        ).fetchall()
    assert state == [(3, "CrashLoop")]
    import json

    assert [(t, json.loads(p)["error_type"]) for t, p in events] == [
        ("task.dead_lettered", "CrashLoop")
    ]


def test_sqlalchemy_sessions_enqueue_in_their_transaction(tasks_dsn: str) -> None:
    import sqlalchemy
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.orm import Session

    tasks = make_tasks()
    url = tasks_dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = sqlalchemy.create_engine(url)
    with Session(engine) as session, session.begin():
        assert tasks.enqueue(session, "job", {"via": "session"}, unique_key="s")
        assert not tasks.enqueue(session, "job", {"via": "session"}, unique_key="s")
    with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
        tasks.enqueue(session, "job", {"via": "rolled back"})
        raise RuntimeError("rolled back")
    engine.dispose()

    async def run() -> None:
        aengine = create_async_engine(url)
        async with aengine.begin() as conn:
            assert await tasks.aenqueue(conn, "job", {"via": "async"})
        await aengine.dispose()

    asyncio.run(run())
    assert count(tasks_dsn, TABLE) == 2
