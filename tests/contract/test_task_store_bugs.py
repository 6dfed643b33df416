"""The task-store contract catches what it guards: each planted bug fails its scenario.

Each bug is an in-memory store with one rule of queue/tasks.py broken, the way a backend
written carelessly would break it; the scenario that guards the rule must fail on it (and
passes on the correct stores, in test_task_store.py). A contract that let one of these
through would prove nothing about a new backend.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from outboxkit.queue.memory_tasks import MemoryTaskRow, MemoryTaskStore
from outboxkit.queue.store import Claim, Settled
from outboxkit.queue.tasks import SUSPECT_LAPSES, ClaimedTask, TaskClaim, TaskClaimed, TaskStatus
from tests.contract import test_task_store as scenarios
from tests.contract.task_backends import MemoryTaskBackend


class NoFencing(MemoryTaskStore):
    """Settles, extends and completes whatever the token (a zombie's settle lands)."""

    def _held(self, task_id: int, token: uuid.UUID) -> MemoryTaskRow | None:
        return self.tasks.row(task_id)


class ChargesNeighbours(MemoryTaskStore):
    """The naive claim: every lapse is charged, whoever ran beside whom (the issue's bug)."""

    async def claim_tasks(self, what: TaskClaim, **kwargs: Any) -> TaskClaimed:
        lapsed = {r.id for r in self.tasks.rows() if r.status is TaskStatus.RUNNING}
        got = await super().claim_tasks(what, **kwargs)
        for task in got.claim.items if got.claim else []:
            row = self.tasks.row(task.id)
            if task.id in lapsed and row is not None:
                row.spared = task.spared = 0  # as if it had run alone: charged
                row.lapses = SUSPECT_LAPSES
        return got


class NoKeySerial(MemoryTaskStore):
    """Claims a keyed task while an earlier one of its key is live (its tasks all pending,
    none held back for its key's turn)."""

    async def claim_tasks(self, what: TaskClaim, **kwargs: Any) -> TaskClaimed:
        for row in self.tasks.rows():
            if row.status is TaskStatus.WAITING and row.after_failure is None:
                row.status = TaskStatus.PENDING
        return await super().claim_tasks(what, **kwargs)

    def _claimable(
        self, row: MemoryTaskRow, queue: str, now: float, per_key: int = 1, fair: bool = False
    ) -> bool:
        key, row.key = row.key, None
        try:
            return super()._claimable(row, queue, now, per_key, fair)
        finally:
            row.key = key


class HidesSuspects(MemoryTaskStore):
    """Passes over suspects without saying so: nobody ever runs them alone."""

    async def claim_tasks(self, what: TaskClaim, **kwargs: Any) -> TaskClaimed:
        got = await super().claim_tasks(what, **kwargs)
        return TaskClaimed(got.claim, False)


class ReleaseKeepsTheAttempt(MemoryTaskStore):
    """A release at shutdown charges the attempt it hands back."""

    async def release(self, claim: Claim[ClaimedTask]) -> int:
        count = await super().release(claim)
        for task_id in claim.ids:
            row = self.tasks.row(task_id)
            if row is not None:
                row.attempts += 1
        return count


class SettleKeepsLapses(MemoryTaskStore):
    """A task that ran to an outcome stays a suspect for ever."""

    async def settle(self, claim: Claim[ClaimedTask], decisions: Any) -> Settled:
        before = {i: r.lapses for i in claim.ids if (r := self.tasks.row(i)) is not None}
        settled = await super().settle(claim, decisions)
        for task_id, lapses in before.items():
            row = self.tasks.row(task_id)
            if row is not None:
                row.lapses = lapses
        return settled


class UnfencedProgressAndResults(MemoryTaskStore):
    """Progress and results written by task id alone: a zombie's land over the live ones."""

    async def progress(self, updates: Any) -> int:
        for task_id, _token, value in updates:
            row = self.tasks.row(task_id)
            if row is not None:
                row.progress = value
        return len(updates)

    async def settle(self, claim: Claim[ClaimedTask], decisions: Any) -> Settled:
        for task in claim.items:
            row = self.tasks.row(task.id)
            if row is not None and task.keep is not None:
                row.result = task.result
        return await super().settle(claim, decisions)


class ReleasesAtTheFirstUpstream(MemoryTaskStore):
    """The naive fan-in: a dependent runs as soon as any one of its upstream tasks is done."""

    async def release_dependents(self, ids: Any, limit: int) -> int:
        moved = 0
        for row in self.tasks.rows():
            if (
                row.status is TaskStatus.WAITING
                and ids
                and set(ids) & set(self.tasks.upstream.get(row.id, []))
            ):
                row.status, moved = TaskStatus.PENDING, moved + 1
        return moved + await super().release_dependents(ids, limit)


class WorkerLocalLimit(MemoryTaskStore):
    """The naive concurrency limit: each worker counts only the tasks it claimed itself (a
    per-worker semaphore): three workers run three times the limit."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mine: set[uuid.UUID] = set()

    async def claim_tasks(self, what: TaskClaim, **kwargs: Any) -> TaskClaimed:
        if what.concurrency is None:
            return await super().claim_tasks(what, **kwargs)
        now = self.tasks.clock()
        held = sum(
            1 for r in self.tasks.rows()
            if r.claim_token in self.mine
            and r.status is TaskStatus.RUNNING
            and r.available_at > now
        )  # fmt: skip
        kwargs["limit"] = max(0, min(kwargs["limit"], what.concurrency - held))
        self.mine.add(kwargs["token"])
        return await super().claim_tasks(TaskClaim(what.queue, what.alone, what.name), **kwargs)


class RevivesLapsedLeases(MemoryTaskStore):
    """A heartbeat that extends a lapsed lease (its slot may be another task's by then)."""

    async def extend_leases(self, claim: Claim[ClaimedTask], lease: float) -> int:
        for task_id in claim.ids:
            row = self._held(task_id, claim.token)
            if row is not None:
                row.available_at = self.tasks.clock() + 1
        return await super().extend_leases(claim, lease)


class WorkerLocalBucket(MemoryTaskStore):
    """The naive rate limit: each worker keeps its own token buckets, the name's and each
    key's (three workers start three times the rate)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bucket: dict[str, tuple[float, float]] = {}
        self.key_buckets: dict[tuple[str, str], tuple[float, float, float, float]] = {}

    async def claim_tasks(self, what: TaskClaim, **kwargs: Any) -> TaskClaimed:
        shared = self.tasks.buckets, self.tasks.key_buckets
        self.tasks.buckets, self.tasks.key_buckets = self.bucket, self.key_buckets
        try:
            return await super().claim_tasks(what, **kwargs)
        finally:
            self.tasks.buckets, self.tasks.key_buckets = shared


class WorkerLocalKeyLimit(MemoryTaskStore):
    """The naive per-key limit: every task of a key is claimable and each worker counts only
    the tasks of a key it claimed itself (a semaphore per key in the worker): three workers
    run three times the limit of a key."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mine: set[uuid.UUID] = set()

    async def claim_tasks(self, what: TaskClaim, **kwargs: Any) -> TaskClaimed:
        if what.per_key == 1:
            return await super().claim_tasks(what, **kwargs)
        rows, now = self.tasks.rows(), self.tasks.clock()
        for row in rows:  # no key waits its turn
            if row.status is TaskStatus.WAITING and row.after_failure is None:
                row.status = TaskStatus.PENDING
        held = Counter(
            r.key for r in rows
            if r.claim_token in self.mine and r.status is TaskStatus.RUNNING
            and r.available_at > now
        )  # fmt: skip
        self.mine.add(kwargs["token"])
        got = await super().claim_tasks(dataclasses.replace(what, per_key=len(rows) + 1), **kwargs)
        if got.claim is None:
            return got
        kept = []
        for task in got.claim.items:  # over this worker's own count: handed back
            row = self.tasks.row(task.id)
            if task.key is not None and held[task.key] >= what.per_key and row is not None:
                row.status, row.claim_token, row.attempts = (
                    TaskStatus.PENDING,
                    None,
                    task.attempt - 1,
                )
                continue
            held[task.key] += 1
            kept.append(task)
        claim = Claim(got.claim.token, [t.id for t in kept], kept, got.claim.dead)
        return TaskClaimed(claim if kept or claim.dead else None, got.suspects)


class OneBucketForEveryKey(MemoryTaskStore):
    """The per-key rate kept in the name's one bucket: one key's burst spends every other
    key's tokens."""

    async def claim_tasks(self, what: TaskClaim, **kwargs: Any) -> TaskClaimed:
        if what.key_rate is not None:
            what = dataclasses.replace(what, rate=what.key_rate, burst=what.key_burst,
                                       key_rate=None)  # fmt: skip
        return await super().claim_tasks(what, **kwargs)


class FairInIdOrder(MemoryTaskStore):
    """A fair key's promoted tasks keep their place (enqueue time, id): a key that flooded
    is always first, and another key's task waits behind the whole flood."""

    def _promote(self, keys: set[str], *, sweep: bool = False) -> int:
        due = {r.id: r.available_at for r in self.tasks.rows()}
        moved = super()._promote(keys, sweep=sweep)
        for row in self.tasks.rows():
            row.available_at = due.get(row.id, row.available_at)
        return moved


class FairKeyAllPending(MemoryTaskStore):
    """Every waiting task of a fair key made pending at once (no share): the flood fills
    every claim ahead of the other keys' tasks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "fair_share": 1_000_000})


class ParksInIdOrder(MemoryTaskStore):
    """Tasks behind a full limit parked and promoted by id, priority and due time
    forgotten: a later task of higher priority waits behind every earlier one."""

    def _promote_parked(self, name: str, queue: str, count: int) -> int:
        due = {r.id: (r.priority, r.available_at) for r in self.tasks.rows()}
        for row in self.tasks.rows():
            row.priority, row.available_at = 0, 0.0  # (the sweep's sort sees ids alone)
        try:
            return super()._promote_parked(name, queue, count)
        finally:
            for row in self.tasks.rows():
                row.priority, row.available_at = due[row.id]

    def _park(self, limit: int) -> int:
        due = {r.id: (r.priority, r.available_at) for r in self.tasks.rows()}
        for row in self.tasks.rows():
            row.priority, row.available_at = 0, 0.0
        try:
            return super()._park(limit)
        finally:
            for row in self.tasks.rows():
                row.priority, row.available_at = due[row.id]


class ParkedForGood(MemoryTaskStore):
    """Parks the tasks behind a full limit and never promotes them: they wait forever
    once the pending ones are claimed."""

    def _promote_parked(self, name: str, queue: str, count: int) -> int:
        return 0


class FairUnknownToTheEnqueue(MemoryTaskStore):
    """Never tells the table its fair names: a fair key's task enqueued while its key has a
    live task waits for a promotion, and a key that enqueues faster than a claim round
    queues behind itself."""

    def _tell_fair(self) -> None:
        pass


Scenario = Callable[[Any], Awaitable[None]]
BUGS: list[tuple[type[MemoryTaskStore], Scenario]] = [
    (NoFencing, scenarios.test_a_stale_claim_settles_extends_and_releases_nothing),
    (
        NoFencing,
        scenarios.test_a_completion_in_the_handlers_transaction_is_fenced_by_the_claim_token,
    ),
    (
        ChargesNeighbours,
        scenarios.test_a_task_that_lapsed_beside_others_is_not_charged_and_turns_suspect,
    ),
    (
        ChargesNeighbours,
        scenarios.test_only_deaths_while_running_alone_are_charged_up_to_the_crash_loop_guard,
    ),
    (NoKeySerial, scenarios.test_a_keyed_task_is_claimable_only_after_the_earlier_tasks_of_its_key),
    (
        HidesSuspects,
        scenarios.test_a_task_that_lapsed_beside_others_is_not_charged_and_turns_suspect,
    ),
    (
        ReleaseKeepsTheAttempt,
        scenarios.test_release_hands_tasks_back_at_once_with_the_attempt_refunded,
    ),
    (
        SettleKeepsLapses,
        scenarios.test_a_settled_outcome_clears_the_lapses_and_a_hand_back_keeps_them,
    ),
    (
        ReleasesAtTheFirstUpstream,
        scenarios.test_a_dependent_waits_for_every_upstream_task_and_is_released_by_the_last_settle,
    ),
    (
        UnfencedProgressAndResults,
        scenarios.test_a_kept_result_and_progress_are_written_fenced_and_purged_after_their_time,
    ),
    (
        WorkerLocalLimit,
        scenarios.test_a_limited_name_runs_at_most_its_limit_and_only_a_lapse_or_its_own_settle_frees_one,
    ),
    (
        WorkerLocalLimit,
        scenarios.test_racing_claims_of_a_limited_name_never_fill_more_than_its_limit,
    ),
    (
        WorkerLocalBucket,
        scenarios.test_a_rate_limited_name_starts_its_burst_then_its_rate_and_spends_no_attempt_waiting,
    ),
    (
        RevivesLapsedLeases,
        scenarios.test_a_limited_name_runs_at_most_its_limit_and_only_a_lapse_or_its_own_settle_frees_one,
    ),
    (
        NoFencing,
        scenarios.test_a_limited_name_runs_at_most_its_limit_and_only_a_lapse_or_its_own_settle_frees_one,
    ),
    (
        WorkerLocalKeyLimit,
        scenarios.test_a_key_runs_its_first_n_live_tasks_and_only_a_lapse_or_its_own_settle_frees_one,
    ),
    (
        WorkerLocalKeyLimit,
        scenarios.test_racing_claims_of_a_key_never_run_more_than_its_per_key_limit,
    ),
    (
        NoKeySerial,
        scenarios.test_a_key_runs_its_first_n_live_tasks_and_only_a_lapse_or_its_own_settle_frees_one,
    ),
    (
        NoFencing,
        scenarios.test_a_key_runs_its_first_n_live_tasks_and_only_a_lapse_or_its_own_settle_frees_one,
    ),
    (
        RevivesLapsedLeases,
        scenarios.test_a_key_runs_its_first_n_live_tasks_and_only_a_lapse_or_its_own_settle_frees_one,
    ),
    (
        WorkerLocalBucket,
        scenarios.test_each_key_starts_its_burst_then_its_rate_and_spends_no_attempt_waiting,
    ),
    (
        OneBucketForEveryKey,
        scenarios.test_each_key_starts_its_burst_then_its_rate_and_spends_no_attempt_waiting,
    ),
    (
        FairInIdOrder,
        scenarios.test_a_fair_key_keeps_its_share_pending_and_a_later_key_is_claimed_behind_that_share,
    ),
    (
        FairKeyAllPending,
        scenarios.test_a_fair_key_keeps_its_share_pending_and_a_later_key_is_claimed_behind_that_share,
    ),
    (
        FairUnknownToTheEnqueue,
        scenarios.test_a_fair_key_keeps_its_share_pending_and_a_later_key_is_claimed_behind_that_share,
    ),
    (
        ParksInIdOrder,
        scenarios.test_tasks_behind_a_full_limit_wait_parked_and_come_back_by_priority_then_due_time,
    ),
    (
        ParkedForGood,
        scenarios.test_tasks_behind_a_full_limit_wait_parked_and_come_back_by_priority_then_due_time,
    ),
]


@pytest.mark.parametrize(
    ("bug", "scenario"), BUGS, ids=[f"{b.__name__}-{s.__name__[5:40]}" for b, s in BUGS]
)
async def test_the_contract_catches_a_planted_bug(
    bug: type[MemoryTaskStore], scenario: Scenario
) -> None:
    backend = MemoryTaskBackend(store_class=bug)
    try:
        with pytest.raises(AssertionError):
            await scenario(backend)
    finally:
        await backend.close()


async def test_the_same_scenarios_pass_on_the_correct_store() -> None:
    for _bug, scenario in BUGS:
        backend = MemoryTaskBackend()
        try:
            await scenario(backend)
        finally:
            await backend.close()
