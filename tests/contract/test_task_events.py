"""The task-store contract, lifecycle events (``@tasks.handler(..., events=topic)``): the
settle writes them in its own transaction, so a settle the fence turned away (a zombie's)
writes none, and the crash-loop guard's dead letter writes its own in the claim's. Runs on
every backend whose stores write an outbox (TaskBackend.lifecycle_store)."""

from __future__ import annotations

import pytest

from outboxkit.queue.store import DONE, Decision, Verdict
from outboxkit.queue.tasks import SUSPECT_LAPSES, TaskStore
from outboxkit.tasks import Tasks
from tests.contract.task_backends import TaskBackend, claim


def _tasks() -> Tasks:
    tasks = Tasks()
    tasks.handler("job", events="task-events")(lambda payload: None)
    tasks.handler("quiet")(lambda payload: None)  # (no events=: none written)
    return tasks


def _store(b: TaskBackend) -> TaskStore:
    store = b.lifecycle_store(_tasks())
    if store is None:
        pytest.skip(f"{b.name}'s stores write no outbox table")
    return store


async def test_each_settled_outcome_writes_its_lifecycle_event_and_only_opted_in_names(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    store = _store(b)
    done, retried, dead, handed = [await b.enqueue() for _ in range(4)]
    quiet = await b.enqueue("quiet")
    c = (await claim(store)).claim
    assert c is not None and sorted(c.ids) == [done, retried, dead, handed, quiet]
    verdicts = {
        done: DONE,
        retried: Decision(Verdict.RETRY, 60.0, "boom"),
        dead: Decision(Verdict.DEAD, 0.0, "gone"),
        handed: Decision(Verdict.HAND_BACK, 0.0),  # (not an outcome: no event)
        quiet: DONE,
    }
    await store.settle(c, [verdicts[i] for i in c.ids])
    assert sorted(await b.events()) == sorted([
        ("task.completed", done), ("task.failed", retried), ("task.dead_lettered", dead),
    ])  # fmt: skip


async def test_a_zombies_settle_writes_no_event_and_the_live_claims_writes_one(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    store = _store(b)
    task = await b.enqueue()
    zombie = (await claim(store, lease=5)).claim
    assert zombie is not None
    await b.advance(6)  # its lease ran out: another claim takes the task
    live = (await claim(store)).claim
    assert live is not None and live.ids == [task]
    # The naive hook (events for what the claim held) would write one here: the fence
    # turned the settle away, and its event with it.
    assert (await store.settle(zombie, [DONE])).lost == 1
    assert await b.events() == []
    await store.settle(live, [DONE])
    assert await b.events() == [("task.completed", task)]


async def test_the_crash_loop_guards_dead_letter_writes_its_event_in_the_claim(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    store = _store(b)
    poison = await b.enqueue(max_attempts=1)
    for _ in range(SUSPECT_LAPSES + 2):  # died running it, beside others then alone
        got = await claim(store, lease=5)
        if got.claim is None:
            assert got.suspects
            got = await claim(store, lease=5, alone=True, limit=1)
        assert got.claim is not None
        if not got.claim.ids:
            break
        await b.advance(6)
    assert got.claim is not None and [t.id for t, _k, _e in got.claim.dead] == [poison]
    assert await b.events() == [("task.dead_lettered", poison)]
