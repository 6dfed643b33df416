"""Task mode's claim policies (queue/task_claims.py) on the in-memory task store: queues in
turn, per-queue limits, and a suspect run alone after the worker drained."""

from __future__ import annotations

import uuid

import pytest

from outboxkit.queue.memory import ManualClock
from outboxkit.queue.memory_tasks import MemoryTasks, MemoryTaskStore
from outboxkit.queue.store import DONE, Claim
from outboxkit.queue.task_claims import TaskClaims
from outboxkit.queue.tasks import SUSPECT_LAPSES, ClaimedTask


def _claims(tasks: MemoryTasks, **options: object) -> tuple[TaskClaims, list[str]]:
    queues = options.pop("queues", ["default"])
    per_key = options.get("per_key")  # (the worker gives its store and its claims both)
    store = MemoryTaskStore(tasks, queues=queues, per_key=per_key)  # type: ignore[arg-type]
    claims = TaskClaims(store, queues=queues, **options)  # type: ignore[arg-type]
    woken: list[str] = []
    claims.on_free = lambda: woken.append("wake")
    return claims, woken


async def _claim(claims: TaskClaims, limit: int = 10) -> Claim[ClaimedTask] | None:
    return await claims.claim(limit=limit, lease=5.0, token=uuid.uuid4(), owner="w", max_attempts=5)


async def test_the_queues_are_served_in_turn() -> None:
    tasks = MemoryTasks(clock=ManualClock(100.0))
    for _ in range(3):
        tasks.enqueue("a", queue="a")
        tasks.enqueue("b", queue="b")
    claims, _ = _claims(tasks, queues=["a", "b"])
    served = []
    for _ in range(4):
        c = await _claim(claims, limit=1)
        assert c is not None
        served.append(c.items[0].queue)
    assert served == ["a", "b", "a", "b"]


async def test_a_queue_at_its_limit_is_passed_over_until_a_task_of_it_settles() -> None:
    tasks = MemoryTasks(clock=ManualClock(100.0))
    for _ in range(3):
        tasks.enqueue("slow", queue="slow")
    tasks.enqueue("fast", queue="fast")
    claims, woken = _claims(tasks, queues=["slow", "fast"], queue_limits={"slow": 1})
    first = await _claim(claims)
    assert first is not None and [t.queue for t in first.items] == ["slow"]
    second = await _claim(claims)
    assert second is not None and [t.queue for t in second.items] == ["fast"]
    assert await _claim(claims) is None  # slow is at its limit, fast is empty
    await claims.settle(first, [DONE])
    assert woken == ["wake"]  # room again: claim now, not at the poll
    third = await _claim(claims)
    assert third is not None and [t.queue for t in third.items] == ["slow"]


async def test_a_suspect_waits_for_the_worker_to_drain_then_runs_alone() -> None:
    clock = ManualClock(100.0)
    tasks = MemoryTasks(clock=clock)
    poison = tasks.enqueue("poison")
    for _ in range(SUSPECT_LAPSES):  # its worker died twice while it ran beside others
        dead, _ = _claims(tasks)
        assert await _claim(dead) is not None
        clock.advance(6)
    healthy = [tasks.enqueue("job") for _ in range(3)]
    claims, woken = _claims(tasks)
    # the suspect takes a place in the statement's batch but is passed over
    running = await _claim(claims, limit=3)
    assert running is not None and running.ids == healthy[:2]
    assert await _claim(claims) is None  # draining: nothing new while they run
    parts = [
        Claim(running.token, [i], [t]) for i, t in zip(running.ids, running.items, strict=True)
    ]
    await claims.settle(parts[0], [DONE])
    assert woken == []  # still one running
    await claims.settle(parts[1], [DONE])
    assert woken == ["wake"]
    alone = await _claim(claims)
    assert alone is not None and alone.ids == [poison] and claims.claimed_alone == 1
    assert await _claim(claims) is None  # it runs alone: nothing beside it
    await claims.settle(alone, [DONE])
    rest = await _claim(claims)
    assert rest is not None and rest.ids == [healthy[2]]


async def test_limited_names_take_turns_with_the_rest_of_their_queue_and_keep_their_caps() -> None:
    tasks = MemoryTasks(clock=ManualClock(100.0))
    for _ in range(5):
        tasks.enqueue("free")
        tasks.enqueue("capped")
        tasks.enqueue("paced")
    claims, _ = _claims(tasks, concurrency={"capped": 2}, rates={"paced": (1.0, 1)})
    served = []
    for _ in range(6):
        c = await _claim(claims, limit=10)
        served.append([] if c is None else [t.task_name for t in c.items])
    # the queue's claim (free names only), then each limited name on its own, in turn
    assert served[:3] == [["free"] * 5, ["capped"] * 2, ["paced"]]
    assert served[3:] == [[], [], []]  # free drained, capped full, paced out of tokens


def test_handler_limits_are_checked_where_they_are_declared() -> None:
    from outboxkit.tasks import Tasks
    from outboxkit.tasks.registry import parse_rate

    assert parse_rate("t", "50/s") == (50.0, 5)
    assert parse_rate("t", "120/min") == (2.0, 12)
    assert parse_rate("t", "3/h") == (3 / 3600, 1)
    tasks = Tasks()
    for bad in ("50", "50/day", "0/s", "x/s"):
        with pytest.raises(ValueError, match="rate of task 't'"):
            tasks.handler("t", rate=bad)
    with pytest.raises(ValueError, match="concurrency of task 't' must be at least 1"):
        tasks.handler("t", concurrency=0)


def test_per_key_limits_are_checked_where_they_are_declared() -> None:
    from outboxkit.tasks import Tasks

    tasks = Tasks()
    for bad in ("50", "50/day", "0/s", "x/s", "inf/s", 5):
        with pytest.raises(ValueError, match="rate_per_key of task 't'"):
            tasks.handler("t", rate_per_key=bad)  # type: ignore[arg-type]
    for count in (0, -1, True, 2.5, "2", 40_000):
        with pytest.raises(ValueError, match="concurrency_per_key of task 't' must be an int"):
            tasks.handler("t", concurrency_per_key=count)  # type: ignore[arg-type]
    tasks.handler("t", concurrency_per_key=3, rate_per_key="2/s")(lambda payload: None)
    declared = tasks.types["t"]
    assert (declared.concurrency_per_key, declared.rate_per_key) == (3, (2.0, 1))


async def test_a_name_limited_per_key_has_a_claim_of_its_own_the_others_skip() -> None:
    tasks = MemoryTasks(clock=ManualClock(100.0))
    for i in range(4):
        tasks.enqueue("fan", key="k")
        tasks.enqueue("paced", key=f"k{i % 2}")
    tasks.enqueue("free", key="k")  # (key k's fifth task: waits behind "fan"'s)
    claims, _ = _claims(tasks, per_key={"fan": 2}, key_rates={"paced": (1.0, 1)})
    served = []
    for _ in range(4):
        c = await _claim(claims, limit=10)
        served.append([] if c is None else sorted(t.task_name for t in c.items))
    # the queue's claim (nothing: the heads of k and k0/k1 are "fan" and "paced"), then
    # "fan" (its first task; the claim makes room for its second), "paced" (one of each key)
    assert served == [["fan"], ["paced", "paced"], ["fan"], []]


def test_fair_is_checked_where_it_is_declared() -> None:
    from outboxkit.tasks import Tasks

    tasks = Tasks()
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="fair of task 't' takes True or False"):
            tasks.handler("t", fair=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="without concurrency_per_key"):
        tasks.handler("t", fair=True, concurrency_per_key=2)
    tasks.handler("t", fair=True)(lambda payload: None)
    assert tasks.types["t"].fair


async def test_a_fair_claim_starts_each_keys_first_task_then_each_keys_second() -> None:
    tasks = MemoryTasks(clock=ManualClock(100.0))
    flood = [tasks.enqueue("fan", key="flood") for _ in range(4)]
    store = MemoryTaskStore(tasks, fair=["fan"], fair_share=3)
    claims = TaskClaims(store, queues=["default"], fair=["fan"])
    woken: list[str] = []
    claims.on_free = lambda: woken.append("wake")
    first = await _claim(claims, limit=1)
    assert first is not None and first.ids == [flood[0]]
    assert woken == ["wake"]  # its next ones are pending: claim again at once, no linger
    light = tasks.enqueue("fan", key="light")
    second = await _claim(claims, limit=10)
    # each key's first task, then the flood's next ones (by id within a turn)
    assert second is not None and second.ids == [flood[1], light, flood[2], flood[3]]
