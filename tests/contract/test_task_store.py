"""The task-store contract: every rule of queue/tasks.py, proven on each backend.

Each scenario talks to the port only (claim_tasks, settle, extend_leases, release,
hasten, fail_unhandled, the handler's transaction and its fenced completion) and reads the
stored state through the harness (task_backends.py). test_task_store_bugs.py runs them on
in-memory stores with one rule broken each: the scenario that guards the rule must fail.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from outboxkit.backends.ports import Feature
from outboxkit.queue.store import DONE, Decision, Verdict
from outboxkit.queue.tasks import SUSPECT_LAPSES, TaskStore
from tests.contract.task_backends import TaskBackend, claim


def _needs(b: TaskBackend, feature: Feature) -> None:
    """Skip on a backend that refuses ``feature`` (its worker says so at start, in a line)."""
    if (reason := b.lacks(feature)) is not None:
        pytest.skip(f"{b.name} refuses it: {reason}")


async def test_a_claim_takes_due_tasks_by_priority_then_due_time_and_counts_an_attempt(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    low = await b.enqueue()
    high = await b.enqueue(priority=5)
    later = await b.enqueue(priority=9, delay=60)
    low2 = await b.enqueue()
    store = b.store()
    got = await claim(store, limit=2)
    assert got.claim is not None and sorted(got.claim.ids) == sorted([high, low])
    assert [t.attempt for t in got.claim.items] == [1, 1]
    row = await b.row(high)
    assert row is not None and (row.status, row.attempts, row.due) == ("running", 1, False)
    assert row.claim_token == got.claim.token
    rest = await claim(store)
    assert rest.claim is not None and rest.claim.ids == [low2]  # not `later`: not due
    assert (await claim(store)).claim is None
    await store.settle(got.claim, [DONE, DONE])
    await store.settle(rest.claim, [DONE])
    await b.advance(61)
    last = await claim(store)
    assert last.claim is not None and last.claim.ids == [later]


async def test_a_claim_takes_only_its_queue_and_the_names_it_handles(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    mine = await b.enqueue("mine", queue="a")
    await b.enqueue("other", queue="a")
    await b.enqueue("mine", queue="b")
    got = await claim(b.store(queues=["a", "b"], names=["mine"]), queue="a")
    assert got.claim is not None and got.claim.ids == [mine]


async def test_a_keyed_task_is_claimable_only_after_the_earlier_tasks_of_its_key(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    a0, a1 = await b.enqueue(key="a"), await b.enqueue(key="a")
    b0 = await b.enqueue(key="b")
    store = b.store()
    first = await claim(store)
    assert first.claim is not None and first.claim.ids == [a0, b0]
    assert (await claim(store)).claim is None  # a1 waits for a0, running
    await store.settle(first.claim, [DONE, DONE])
    second = await claim(store)
    assert second.claim is not None and second.claim.ids == [a1]


async def test_concurrent_claims_take_every_task_exactly_once(task_backend: TaskBackend) -> None:
    b = task_backend
    ids = {await b.enqueue() for _ in range(40)}
    stores = [b.store() for _ in range(4)]

    async def drain(store: object) -> list[int]:
        got: list[int] = []
        while True:
            c = await claim(store, limit=3)  # type: ignore[arg-type]
            if c.claim is None:
                return got
            got += c.claim.ids

    claimed = await asyncio.gather(*(drain(s) for s in stores))
    every = [i for ids_of_one in claimed for i in ids_of_one]
    assert sorted(every) == sorted(ids)


async def test_a_stale_claim_settles_extends_and_releases_nothing(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    task = await b.enqueue()
    store = b.store()
    stale = (await claim(store, lease=5)).claim
    assert stale is not None
    await b.advance(6)
    live = (await claim(store)).claim
    assert live is not None and live.ids == [task]
    assert (await store.settle(stale, [DONE])).lost == 1
    assert await store.extend_leases(stale, 30) == 0
    assert await store.release(stale) == 0
    row = await b.row(task)
    assert row is not None and (row.status, row.claim_token) == ("running", live.token)
    assert list((await store.settle(live, [DONE])).ids) == [task]
    assert await b.row(task) is None


async def test_settle_applies_retry_dead_letter_and_hand_back_each_to_its_task(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    retried, dead, handed, done = [await b.enqueue() for _ in range(4)]
    store = b.store()
    c = (await claim(store)).claim
    assert c is not None and c.ids == [retried, dead, handed, done]
    decisions = [
        Decision(Verdict.RETRY, 60.0, "boom"),
        Decision(Verdict.DEAD, 0.0, "gone"),
        Decision(Verdict.HAND_BACK, 0.0),
        DONE,
    ]
    assert sorted((await store.settle(c, decisions)).ids) == sorted(c.ids)
    r, d, h = await b.row(retried), await b.row(dead), await b.row(handed)
    assert r is not None and (r.status, r.attempts, r.due, r.last_error) == (
        "pending", 1, False, "boom",
    )  # fmt: skip
    assert d is not None and (d.status, d.last_error) == ("failed", "gone")
    assert h is not None and (h.status, h.attempts, h.due) == ("pending", 0, True)
    assert await b.row(done) is None


async def test_release_hands_tasks_back_at_once_with_the_attempt_refunded(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    task = await b.enqueue()
    store = b.store()
    c = (await claim(store)).claim
    assert c is not None
    assert await store.release(c) == 1
    row = await b.row(task)
    assert row is not None and (row.status, row.attempts, row.due) == ("pending", 0, True)
    assert row.claim_token is None


async def test_extend_leases_keeps_a_running_task_from_other_claims(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    await b.enqueue()
    store = b.store()
    c = (await claim(store, lease=10)).claim
    assert c is not None
    await b.advance(8)
    assert await store.extend_leases(c, 10) == 1
    await b.advance(8)
    assert (await claim(b.store())).claim is None


async def test_a_completion_in_the_handlers_transaction_is_fenced_by_the_claim_token(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    task = await b.enqueue()
    store = b.store()
    c = (await claim(store)).claim
    assert c is not None
    with store.transaction("contract") as conn:
        assert not store.complete(conn, task, uuid.uuid4())  # another attempt's token
        conn.rollback()
    assert (await b.row(task)) is not None
    async with store.atransaction("contract") as conn:
        assert await store.acomplete(conn, task, c.token)
        await conn.rollback()
    row = await b.row(task)
    assert row is not None and row.status == "running"  # rolled back: not completed
    with store.transaction("contract") as conn:
        assert store.complete(conn, task, c.token)
        conn.commit()
    assert await b.row(task) is None
    c.items[0].completed = True
    assert list((await store.settle(c, [DONE])).ids) == [task]  # nothing left to do


async def test_a_task_that_lapsed_beside_others_is_not_charged_and_turns_suspect(
    task_backend: TaskBackend,
) -> None:
    """A worker died holding three tasks: nothing says which killed it. None is charged;
    after SUSPECT_LAPSES such deaths a task is taken only by a claim that runs it alone."""
    b = task_backend
    tasks = [await b.enqueue() for _ in range(3)]
    store = b.store()
    for lapse in range(1, SUSPECT_LAPSES):
        c = (await claim(store, lease=5)).claim
        assert c is not None and c.ids == tasks
        await b.advance(6)  # the worker died: nobody settles, the leases run out
        again = await claim(store, lease=5)
        assert again.claim is not None and again.claim.ids == tasks
        assert [t.attempt for t in again.claim.items] == [lapse + 1] * 3  # a new attempt each
        assert [t.spared for t in again.claim.items] == [lapse] * 3  # but none charged
        rows = [await b.row(t) for t in tasks]
        assert [(r.lapses, r.spared) for r in rows if r] == [(lapse, lapse)] * 3
        await b.advance(6)
    passed = await claim(store)  # now suspects: a claim that is not alone passes them
    assert passed.claim is None and passed.suspects
    alone = await claim(store, alone=True, limit=1)
    assert alone.claim is not None and alone.claim.ids == [tasks[0]] and not alone.suspects
    assert alone.claim.items[0].spared == SUSPECT_LAPSES  # its last death was ambiguous too
    row = await b.row(tasks[0])
    assert row is not None and (row.status, row.lapses) == ("running", SUSPECT_LAPSES)
    assert row.attempts - row.spared == 1  # only this claim counts


async def test_only_deaths_while_running_alone_are_charged_up_to_the_crash_loop_guard(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    poison = await b.enqueue(max_attempts=2)
    store = b.store()
    attempts: list[int] = []
    while len(attempts) < 10:
        got = await claim(store, lease=5)
        if got.claim is None:
            assert got.suspects
            got = await claim(store, lease=5, alone=True, limit=1)
        assert got.claim is not None
        if not got.claim.ids:
            break
        attempts.append(got.claim.items[0].attempt)
        await b.advance(6)  # died running it
    # two deaths beside others (spared), then two alone (charged: its max_attempts of 2)
    assert attempts == list(range(1, SUSPECT_LAPSES + 3))
    (task, kind, error) = got.claim.dead[0]
    assert (task.id, kind) == (poison, "crash_loop") and "without finishing" in error
    row = await b.row(poison)
    assert row is not None and (row.status, row.error_type) == ("failed", "CrashLoop")


async def test_a_settled_outcome_clears_the_lapses_and_a_hand_back_keeps_them(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    task = await b.enqueue()
    store = b.store()
    for _ in range(SUSPECT_LAPSES):
        assert (await claim(store, lease=5)).claim is not None
        await b.advance(6)
    c = (await claim(store, alone=True, limit=1)).claim
    assert c is not None
    await store.settle(c, [Decision(Verdict.HAND_BACK, 0.0)])  # not run: still a suspect
    assert (await claim(store)).suspects
    c = (await claim(store, alone=True, limit=1)).claim
    assert c is not None
    await store.settle(c, [Decision(Verdict.RETRY, 0.0, "a plain failure")])  # it ran
    row = await b.row(task)
    assert row is not None and (row.lapses, row.attempts, row.spared) == (0, 3, 2)
    fresh = await claim(store)
    assert fresh.claim is not None and fresh.claim.ids == [task] and not fresh.suspects


async def test_fail_unhandled_fails_only_tasks_of_names_no_worker_has_past_the_grace(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    orphan = await b.enqueue("orphan")
    handled = await b.enqueue("mine")
    young = await b.enqueue("orphan", delay=50)
    store = b.store(names=["mine"])
    assert await store.fail_unhandled(100, 10) == []
    await b.advance(120)
    assert await store.fail_unhandled(100, 10) == ["orphan"]
    o, h, y = await b.row(orphan), await b.row(handled), await b.row(young)
    assert o is not None and (o.status, o.error_type) == ("failed", "UnknownTask")
    assert h is not None and h.status == "pending"
    assert y is not None and y.status == "pending"  # due only 70 s ago


async def test_hasten_makes_handed_back_tasks_due_now(task_backend: TaskBackend) -> None:
    b = task_backend
    task = await b.enqueue()
    store = b.store()
    c = (await claim(store)).claim
    assert c is not None
    await store.settle(c, [Decision(Verdict.HAND_BACK, 60.0)])
    assert (await claim(store)).claim is None
    assert await store.hasten([task]) == 1
    again = await claim(store)
    assert again.claim is not None and again.claim.ids == [task]


async def test_a_kept_result_and_progress_are_written_fenced_and_purged_after_their_time(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    task = await b.enqueue()
    store = b.store()
    zombie = (await claim(store, lease=1)).claim
    assert zombie is not None
    await b.advance(2)  # the zombie froze past its lease; another worker takes the task
    live = (await claim(store)).claim
    assert live is not None and live.ids == [task]
    assert await store.progress([(task, zombie.token, '"zombie"')]) == 0
    assert await store.progress([(task, live.token, '{"done": 3}')]) == 1
    row = await b.row(task)
    assert row is not None and row.progress == {"done": 3}
    zombie.items[0].keep, zombie.items[0].result = 60.0, '"zombie"'
    assert not list((await store.settle(zombie, [DONE])).ids)  # fenced: nothing stored
    row = await b.row(task)
    assert row is not None and (row.status, row.result) == ("running", None)
    live.items[0].keep, live.items[0].result = 60.0, '{"value": [1, 2]}'
    assert list((await store.settle(live, [DONE])).ids) == [task]
    row = await b.row(task)  # kept (retention "delete" notwithstanding), with its value
    assert row is not None and (row.status, row.result, row.kept) == (
        "done",
        {"value": [1, 2]},
        True,
    )
    assert row.progress == {"done": 3}
    assert await store.purge_kept(10) == 0  # not yet
    await b.advance(61)
    assert await store.purge_kept(10) == 1
    assert await b.row(task) is None


async def test_a_result_of_a_task_completed_in_its_transaction_follows_the_completion(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    task = await b.enqueue()
    store = b.store()
    c = (await claim(store)).claim
    assert c is not None
    with store.transaction("contract") as conn:
        assert store.complete(conn, task, c.token, 60.0)
        conn.commit()
    row = await b.row(task)  # done and kept; the value exists once the handler returned
    assert row is not None and (row.status, row.result, row.kept) == ("done", None, True)
    item = c.items[0]
    item.completed, item.keep, item.result = True, 60.0, '"made"'
    assert list((await store.settle(c, [DONE])).ids) == [task]
    row = await b.row(task)
    assert row is not None and row.result == "made"


async def test_a_dependent_waits_for_every_upstream_task_and_is_released_by_the_last_settle(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    z = await b.enqueue("child")
    a, c = await b.enqueue("child"), await b.enqueue("child")
    callback = await b.enqueue("callback", after=[z, a, c])
    row = await b.row(callback)
    assert row is not None and row.status == "waiting"
    store, other = b.store(), b.store()
    early = (await claim(store, limit=1)).claim
    assert early is not None and early.ids == [z]
    await store.settle(early, [DONE])
    row = await b.row(callback)
    assert row is not None and row.status == "waiting"  # two upstream tasks still live
    first = (await claim(store, limit=1)).claim
    second = (await claim(other, limit=1)).claim
    assert first is not None and second is not None
    assert {first.ids[0], second.ids[0]} == {a, c}  # never the waiting callback
    assert (await claim(store)).claim is None
    # Both children finish at the same instant on two workers: released exactly once.
    await asyncio.gather(store.settle(first, [DONE]), other.settle(second, [DONE]))
    row = await b.row(callback)
    assert row is not None and row.status == "pending"
    got = (await claim(store)).claim
    assert got is not None and got.ids == [callback]
    assert await store.release_dependents(None, 10) == 0  # nothing left to decide
    with store.transaction("contract") as conn:
        upstream = store.dependencies(conn, callback)
    assert [r["after_id"] for r in upstream] == [z, a, c]  # done, deleted: their ids alone
    assert [r["id"] for r in upstream] == [None, None, None]


async def test_a_failed_upstream_task_cancels_its_dependent_or_lets_it_run_anyway(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    up, fine = await b.enqueue("child"), await b.enqueue("child")
    cancelled = await b.enqueue("callback", after=[up, fine])
    runs_anyway = await b.enqueue("callback", after=[up], after_failure=1)
    store = b.store()
    got = (await claim(store)).claim
    assert got is not None and sorted(got.ids) == [up, fine]
    dead = Decision(Verdict.DEAD, error="boom")
    decisions = [dead if i == up else DONE for i in got.ids]
    await store.settle(got, decisions)
    gone = await b.row(cancelled)
    assert gone is not None and (gone.status, gone.error_type) == ("cancelled", "UpstreamFailed")
    assert gone.last_error is not None and f"upstream task {up} failed" in gone.last_error
    anyway = await b.row(runs_anyway)
    assert anyway is not None and anyway.status == "pending"


async def test_the_sweep_releases_a_dependent_whose_upstream_finished_without_a_release(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    up = await b.enqueue("child")
    waiting = await b.enqueue("callback", after=[up])
    store = b.store()
    got = (await claim(store)).claim
    assert got is not None and got.ids == [up]
    got.items[0].has_dependents = False  # as if claimed before the dependent's enqueue
    await store.settle(got, [DONE])
    row = await b.row(waiting)
    assert row is not None and row.status == "waiting"  # nobody released it
    assert await store.release_dependents(None, 10) == 1
    row = await b.row(waiting)
    assert row is not None and row.status == "pending"


async def test_a_keys_later_tasks_wait_out_of_the_claim_and_its_heads_end_promotes_the_next(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    head = await b.enqueue(key="tenant-1")
    later = [await b.enqueue(key="tenant-1") for _ in range(3)]
    other = await b.enqueue(key="tenant-2")
    assert [(await b.row(i)).status for i in later] == ["waiting"] * 3  # type: ignore[union-attr]
    store = b.store()
    got = (await claim(store)).claim
    assert got is not None and sorted(got.ids) == [head, other]
    await store.settle(got, [Decision(Verdict.DEAD, error="x") if i == head else DONE
                             for i in got.ids])  # fmt: skip
    # The head failed for good: its key goes on with the next task, in enqueue order.
    assert [(await b.row(i)).status for i in later] == ["pending", "waiting", "waiting"]  # type: ignore[union-attr]
    nxt = (await claim(store)).claim
    assert nxt is not None and nxt.ids == [later[0]]
    nxt.items[0].has_dependents = False
    await store.settle(nxt, [DONE])
    row = await b.row(later[1])
    assert row is not None and row.status == "pending"
    # A key whose next task nobody promoted (its head cancelled by an operator, a worker
    # killed between its settle and the promotion): the sweep does.
    got = (await claim(store)).claim
    assert got is not None and got.ids == [later[1]]
    await b.advance(31)  # the worker died holding it; a new claim takes it over
    again = (await claim(store)).claim
    assert again is not None and again.ids == [later[1]]
    await store.release(again)  # (shutdown: back to pending, still its key's head)
    row = await b.row(later[2])
    assert row is not None and row.status == "waiting"
    assert await store.release_dependents(None, 10) == 0  # its head is live: nothing to do


async def test_a_limited_name_runs_at_most_its_limit_and_only_a_lapse_or_its_own_settle_frees_one(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    limited = [await b.enqueue("lim", priority=5) for _ in range(2)]  # claimed first
    free = [await b.enqueue("free") for _ in range(2)]
    one, two = b.store(), b.store()  # two workers
    first = (await claim(one, name="lim", concurrency=2, lease=5)).claim
    assert first is not None and first.ids == limited
    later = [await b.enqueue("lim") for _ in range(2)]
    assert (await claim(two, name="lim", concurrency=2)).claim is None  # full, whoever asks
    rest = (await claim(two, skip=("lim",))).claim  # the queue's other claim skips "lim"
    assert rest is not None and rest.ids == free
    await b.advance(6)  # `one` froze past its lease: its slots free by the clock
    assert await one.extend_leases(first, 30) == 0  # a lapsed lease is never revived
    second = (await claim(two, name="lim", concurrency=2, limit=1)).claim
    assert second is not None and len(second.ids) == 1
    retaken = (await claim(two, name="lim", concurrency=2)).claim  # one slot left
    assert retaken is not None and len(retaken.ids) == 1
    # the zombie's settles are fenced: they never free a slot `second` or `retaken` holds
    await one.settle(first, [DONE, DONE])
    assert (await claim(one, name="lim", concurrency=2)).claim is None
    await two.settle(second, [DONE])  # a holder's own settle frees its slot
    third = (await claim(one, name="lim", concurrency=2)).claim
    assert third is not None and len(third.ids) == 1
    assert sorted(second.ids + retaken.ids) == limited and third.ids[0] in later


async def test_racing_claims_of_a_limited_name_never_fill_more_than_its_limit(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    for _ in range(30):
        await b.enqueue("lim")
    stores = [b.store() for _ in range(6)]
    got = await asyncio.gather(*(claim(s, name="lim", concurrency=3) for s in stores))
    assert sum(len(g.claim.ids) for g in got if g.claim is not None) == 3


async def test_tasks_behind_a_full_limit_wait_parked_and_come_back_by_priority_then_due_time(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    first = [await b.enqueue("lim", priority=7) for _ in range(2)]
    worker, other = b.store(), b.store()
    held = (await claim(worker, name="lim", concurrency=2, lease=5)).claim
    assert held is not None and held.ids == first  # the limit is full
    low = [await b.enqueue("lim") for _ in range(3)]
    high = await b.enqueue("lim", priority=5)
    later = await b.enqueue("lim", priority=9, delay=20)
    free = await b.enqueue("free")

    async def parked(*ids: int) -> list[bool]:
        return [(r := await b.row(i)) is not None and r.status == "waiting" for i in ids]

    await worker.release_dependents(None, 100)  # the sweep keeps the name's best 2 pending
    if b.parks:
        assert await parked(high, *low, later) == [False, False, True, True, True]
    rest = (await claim(other, skip=("lim",))).claim  # the queue's other claim
    assert rest is not None and rest.ids == [free]
    assert (await claim(other, name="lim", concurrency=2)).claim is None
    await b.advance(6)  # `worker` froze past its lease: its places free by the clock
    again = (await claim(other, name="lim", concurrency=2)).claim
    assert again is not None and again.ids == first
    await worker.settle(held, [DONE, DONE])  # the zombie's settle is fenced: frees nothing
    assert (await claim(worker, name="lim", concurrency=2)).claim is None
    await other.settle(again, [DONE, DONE])  # the holders' own settle frees two places
    nxt = (await claim(worker, name="lim", concurrency=2)).claim
    assert nxt is not None and nxt.ids == [high, low[0]]  # by priority, then due time
    await b.advance(20)  # `later` comes due while parked: the sweep promotes it
    await worker.release_dependents(None, 100)
    if b.parks:
        assert await parked(later, low[1], low[2]) == [False, False, True]
    await worker.settle(nxt, [DONE, DONE])
    last = (await claim(other, name="lim", concurrency=2)).claim
    assert last is not None and last.ids == [later, low[1]]
    await other.settle(last, [DONE, DONE])
    tail = (await claim(other, name="lim", concurrency=2)).claim
    assert tail is not None and tail.ids == [low[2]]


async def test_a_rate_limited_name_starts_its_burst_then_its_rate_and_spends_no_attempt_waiting(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    ids = [await b.enqueue("paced") for _ in range(20)]
    one, two = b.store(), b.store()  # two workers share one bucket
    first = (await claim(one, name="paced", rate=2.0, burst=3)).claim
    assert first is not None and len(first.ids) == 3  # the burst
    assert (await claim(two, name="paced", rate=2.0, burst=3)).claim is None  # no token left
    waiting = await b.row(ids[-1])
    assert waiting is not None and (waiting.status, waiting.attempts) == ("pending", 0)
    await b.advance(1)
    second = (await claim(two, name="paced", rate=2.0, burst=3)).claim
    assert second is not None and len(second.ids) == 2  # one second at 2/s
    assert (await claim(one, name="paced", rate=2.0, burst=3)).claim is None
    await b.advance(60)
    third = (await claim(one, name="paced", rate=2.0, burst=3)).claim
    assert third is not None and len(third.ids) == 3  # refilled up to the burst, no more


async def test_a_key_runs_its_first_n_live_tasks_and_only_a_lapse_or_its_own_settle_frees_one(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    _needs(b, "task_key_limits")
    per_key = {"fan": 2}
    k1 = [await b.enqueue("fan", key="k1") for _ in range(4)]
    k2 = await b.enqueue("fan", key="k2")
    one, two = b.store(per_key=per_key), b.store(per_key=per_key)  # two workers
    first = (await claim(one, name="fan", per_key=2, lease=5)).claim
    assert first is not None and first.ids == [k1[0], k2]
    # The claim made room for k1's second task, and only its second: the third waits.
    assert [(await b.row(i)).status for i in k1[1:]] == ["pending", "waiting", "waiting"]  # type: ignore[union-attr]
    second = (await claim(two, name="fan", per_key=2)).claim
    assert second is not None and second.ids == [k1[1]]
    assert (await claim(two, name="fan", per_key=2)).claim is None  # k1 full, whoever asks
    await b.advance(6)  # `one` froze past its lease: its tasks are claimable again...
    assert await one.extend_leases(first, 30) == 0  # (a lapsed lease is never revived)
    retaken = (await claim(two, name="fan", per_key=2)).claim
    # ... and each holds its place in its key: k1's third task still waits its turn.
    assert retaken is not None and retaken.ids == [k1[0], k2]
    assert (await one.settle(first, [DONE, DONE])).lost == 2  # the zombie frees nothing
    assert (await claim(one, name="fan", per_key=2)).claim is None
    assert [(await b.row(i)).status for i in k1[2:]] == ["waiting", "waiting"]  # type: ignore[union-attr]
    await two.settle(retaken, [DONE, DONE])  # a holder's own settle frees its place
    third = (await claim(one, name="fan", per_key=2)).claim
    assert third is not None and third.ids == [k1[2]]
    row = await b.row(k1[3])
    assert row is not None and row.status == "waiting"


async def test_racing_claims_of_a_key_never_run_more_than_its_per_key_limit(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    _needs(b, "task_key_limits")
    ids = [await b.enqueue("fan", key="k") for _ in range(30)]
    stores = [b.store(per_key={"fan": 3}) for _ in range(6)]
    # A task enqueued behind running ones of its key waits for the sweep (or the next
    # settle or claim of the key) to make room: here the sweep promotes the next two.
    assert await stores[0].release_dependents(None, 10) == 2
    got = await asyncio.gather(*(claim(s, name="fan", per_key=3) for s in stores))
    claimed = sorted(i for g in got if g.claim is not None for i in g.claim.ids)
    assert claimed == ids[:3]
    assert await stores[0].release_dependents(None, 10) == 0  # full: the sweep adds none


async def test_each_key_starts_its_burst_then_its_rate_and_spends_no_attempt_waiting(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    _needs(b, "task_key_limits")
    a = [await b.enqueue("paced", key="a") for _ in range(5)]
    bs = [await b.enqueue("paced", key="b") for _ in range(2)]
    unkeyed = await b.enqueue("paced")
    one, two = b.store(per_key={"paced": 5}), b.store(per_key={"paced": 5})  # one bucket a key
    await one.release_dependents(None, 10)  # (the sweep: 5 of a key may be live at once)

    async def paced(store: TaskStore) -> list[int] | None:
        got = await claim(store, name="paced", per_key=5, key_rate=2.0, key_burst=2, lease=600)
        return None if got.claim is None else sorted(got.claim.ids)

    assert await paced(one) == sorted([*a[:2], *bs, unkeyed])  # each key's burst of 2
    assert await paced(two) is None  # a's bucket is empty, whoever asks
    waiting = await b.row(a[2])
    assert waiting is not None and (waiting.status, waiting.attempts) == ("pending", 0)
    await b.advance(0.5)
    assert await paced(two) == [a[2]]  # half a second at 2/s
    assert await paced(one) is None
    await b.advance(60)
    assert await paced(one) == a[3:]  # refilled up to the burst, no more
    await b.advance(60)  # refilled buckets are the same as none: the maintenance drops them
    assert await one.purge_kept(10) == 2
    assert await one.purge_kept(10) == 0


async def test_a_fair_key_keeps_its_share_pending_and_a_later_key_is_claimed_behind_that_share(
    task_backend: TaskBackend,
) -> None:
    b = task_backend
    _needs(b, "task_key_limits")
    flood = [await b.enqueue("fan", key="flood") for _ in range(10)]
    store = b.store(fair=["fan"], fair_share=3)  # a key's 3 pending at once, however many run

    async def statuses() -> list[str]:
        return [(await b.row(i)).status for i in flood]  # type: ignore[union-attr]

    first = (await claim(store, name="fan", fair=3, limit=1)).claim
    assert first is not None and first.ids == [flood[0]]
    assert await statuses() == ["running"] + ["pending"] * 3 + ["waiting"] * 6
    more = (await claim(store, name="fan", fair=3, limit=2)).claim
    assert more is not None and more.ids == flood[1:3]  # 3 of the key running: not a limit
    assert await statuses() == ["running"] * 3 + ["pending"] * 3 + ["waiting"] * 4
    light = await b.enqueue("fan", key="light")
    await b.advance(1)  # (the promotions below happen later than the light key's enqueue)
    order = []
    for _ in range(5):  # a worker with one free slot at a time
        got = (await claim(store, name="fan", fair=3, limit=1)).claim
        assert got is not None
        order += got.ids
        pending = [s for s in await statuses() if s == "pending"]
        assert len(pending) <= 3
    # The flood's 3 pending when the light key enqueued, then the light key's task: the
    # flood's next ones were made pending after it, behind it.
    assert order == [*flood[3:6], light, flood[6]]
    if not b.fair_enqueue:
        return
    # A fair key's tasks enqueued behind a running one of it are pending at once up to the
    # share (the workers told the table its fair names), the rest wait for a promotion.
    late = await b.enqueue("fan", key="late")
    got = (await claim(store, name="fan", fair=3, limit=1)).claim
    assert got is not None and got.ids == [flood[7]]
    while got is not None and late not in got.ids:
        got = (await claim(store, name="fan", fair=3, limit=1)).claim
    behind = [await b.enqueue("fan", key="late") for _ in range(4)]
    assert [(await b.row(i)).status for i in behind] == ["pending"] * 3 + ["waiting"]  # type: ignore[union-attr]
    assert await store.release_dependents(None, 10) == 0  # nothing for the sweep
