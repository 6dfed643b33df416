"""Task mode's claim policies, decided in the core: which queue, how many, and who runs alone.

:class:`TaskClaims` stands between the claim loop and a backend's task store
(``queue/tasks.py``'s port): the loop sees a queue store (``queue/store.py``) and the
backend sees one :class:`~outboxkit.queue.tasks.TaskClaim` per statement. It decides:

* the worker's queues in turn, starting after the one served last, so one busy queue does
  not starve the others (a claim that finds one queue empty tries the next);
* per-queue limits (``--queue name=N``): at most N tasks of a queue held by this worker at
  once, counted from claim to settle or release;
* concurrency limits (``@tasks.handler(name, concurrency=N)``): a limited name has claims
  of its own, which the store caps by its running tasks across every worker (never a count
  of this worker's: three workers would run 3 N); the queue's other claim skips it. A
  queue's claims take turns as the queues do, so a busy name starves no limited one;
* rate limits (``rate="50/s"``): likewise a claim of its own, capped by the name's token
  bucket in the store;
* per-key limits (``concurrency_per_key=N``, N > 1): a claim of its own too, in which a keyed
  task is claimable while fewer than N earlier tasks of its key are live (the store counts
  them; every other claim takes only a key's head); rate limits per key
  (``rate_per_key="5/s"``): a claim of its own, capped by each key's token bucket;
* fair names (``fair=True``): a claim of its own too, which takes a key's tasks however
  many of the key run; the store keeps at most FAIR_SHARE of a key pending, so no key
  holds another's task back by more than that;
* suspects run alone: when a claim passed over a suspect (a task whose worker died twice
  while it ran beside others), this worker stops claiming, lets its running tasks finish,
  then claims the suspect alone and claims nothing else until it settles. A process-killing
  handler is then charged for its own deaths, never its neighbours for it.

No I/O of its own but the store's; the policy is unit-tested on the in-memory store and
proven on every backend by the task-store contract suite.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from outboxkit.queue.store import Claim, ClaimPolicy, Decision, Settled, StoreInfo
from outboxkit.queue.tasks import FAIR_SHARE, ClaimedTask, TaskClaim, TaskStore

__all__ = ["TaskClaims"]


def _keys_in_turn(claim: Claim[ClaimedTask]) -> None:
    """A fair claim's tasks in the order the worker starts them: by priority, then each
    key's first, each key's second, ... (in id order within a turn), so another key's task
    claimed behind a flood's share starts among the first, not after the whole share."""
    turn: Counter[str | None] = Counter()
    ranked = []
    for task in claim.items:  # (the store's order: priority, then id)
        ranked.append(
            ((-task.priority, turn[task.key] if task.key is not None else 0, task.id), task)
        )
        if task.key is not None:
            turn[task.key] += 1
    ranked.sort(key=lambda pair: pair[0])
    claim.items = [task for _, task in ranked]
    claim.ids = [task.id for task in claim.items]


class TaskClaims:
    """The claim loop's queue store in task mode: ``store`` plus the worker's claim policies.

    ``queue_limits``: at most N tasks of a queue at once (the other queues go on).
    ``concurrency``: task name -> at most N of its tasks running across every worker.
    ``rates``: task name -> (starts per second, burst) across every worker.
    ``per_key``: task name -> at most N of its tasks of one key running across every worker
    (1, any name not given: one at a time).
    ``key_rates``: task name -> (starts per second, burst) of each of its keys.
    ``fair``: the task names whose keys are served in turn (``fair=True``).
    """

    def __init__(
        self,
        store: TaskStore,
        *,
        queues: Sequence[str],
        queue_limits: Mapping[str, int] | None = None,
        concurrency: Mapping[str, int] | None = None,
        rates: Mapping[str, tuple[float, int]] | None = None,
        per_key: Mapping[str, int] | None = None,
        key_rates: Mapping[str, tuple[float, int]] | None = None,
        fair: Sequence[str] = (),
    ) -> None:
        self.store = store
        self.queues = list(queues)
        self.queue_limits = dict(queue_limits or {})
        #: Called when this worker may claim again after passing (a limited queue has room,
        #: its running tasks drained for a suspect, an alone task settled): the worker sets
        #: it to its loop's wake, so the claim happens now, not at the next poll.
        self.on_free: Callable[[], None] | None = None
        self._next_queue = 0
        # One claim value per queue, built once (a claim statement per free slot or so).
        # Each queue's claims: its unlimited names, then each limited name on its own.
        caps, paces = dict(concurrency or {}), dict(rates or {})
        turns = {n: k for n, k in (per_key or {}).items() if k != 1}
        if any(n < 1 for n in caps.values()):
            raise ValueError(f"concurrency limits must be at least 1: {caps}")
        if any(k < 1 for k in turns.values()):
            raise ValueError(f"per-key limits must be at least 1: {turns}")
        key_paces = dict(key_rates or {})
        if any(not r > 0 or b < 1 for r, b in [*paces.values(), *key_paces.values()]):
            raise ValueError(
                f"rates must be > 0 with a burst of at least 1: {paces}, per key {key_paces}"
            )
        if set(fair) & turns.keys():
            raise ValueError(
                f"a fair name has no per-key limit: {sorted(set(fair) & turns.keys())}"
            )
        skip = tuple(sorted(caps.keys() | paces.keys() | turns.keys() | key_paces.keys() | {*fair}))
        self._claims = [TaskClaim(q, skip=skip) for q in self.queues] + [
            TaskClaim(q, name=name, concurrency=caps.get(name), rate=paces.get(name, (None, 1))[0],
                      burst=paces.get(name, (None, 1))[1], per_key=turns.get(name, 1),
                      key_rate=key_paces.get(name, (None, 1))[0],
                      key_burst=key_paces.get(name, (None, 1))[1],
                      fair=FAIR_SHARE if name in fair else None)
            for q in self.queues
            for name in skip
        ]  # fmt: skip
        self._alone_claims = [dataclasses.replace(c, alone=True) for c in self._claims]
        self._held: dict[int, str] = {}  # every task id this worker holds -> its queue
        self._held_count: Counter[str] = Counter()
        self._passed = False  # a claim passed (a queue at its limit, draining, alone)
        self._suspects = False  # a claim passed over a suspect: drain, then claim it alone
        self._alone: int | None = None  # the task running alone, until it settles
        #: Suspects this worker claimed alone (stats, tests).
        self.claimed_alone = 0

    def __repr__(self) -> str:
        return f"TaskClaims({self.store!r}, queues={self.queues!r})"

    # -- the claim ---------------------------------------------------------------------

    async def claim(
        self,
        *,
        limit: int,
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
        policy: ClaimPolicy = None,
    ) -> Claim[ClaimedTask] | None:
        if self._alone is not None or (self._suspects and self._held):
            self._passed = True  # running a task alone, or draining for one
            return None
        store = self.store
        if self._suspects:  # nothing running here: run one suspect alone
            self._suspects = False
            for i in self._in_turn():
                queue = self._claims[i].queue
                if self._room(queue, 1) < 1:
                    continue
                got = await store.claim_tasks(
                    self._alone_claims[i], limit=1, lease=lease, token=token, owner=owner,
                    max_attempts=max_attempts,
                )  # fmt: skip
                if got.claim is not None and got.claim.ids:
                    self._alone = got.claim.ids[0]
                    self.claimed_alone += 1
                    return self._took(i, got.claim)
                if got.claim is not None:
                    return got.claim  # only dead-lettered ones: reported
        for i in self._in_turn():
            what = self._claims[i]
            take = self._room(what.queue, limit)
            if take < 1:
                self._passed = True
                continue
            got = await store.claim_tasks(
                what, limit=take, lease=lease, token=token, owner=owner,
                max_attempts=max_attempts,
            )  # fmt: skip
            if got.suspects:
                self._suspects = True
                if not self._held and (got.claim is None or not got.claim.ids):
                    self.wake_later()  # idle already: claim the suspect at once
            if got.more:  # a fair key's next ones: claim again now, not after a linger
                self.wake_later()
            if got.claim is not None:
                if what.fair is not None:
                    _keys_in_turn(got.claim)
                return self._took(i, got.claim)
            if what.concurrency is not None or what.per_key > 1:
                self._passed = True  # a full limit frees when one of its tasks settles
            if what.rate is not None or what.key_rate is not None:
                self._passed = True  # (a poll later the bucket has refilled)
        return None

    def _in_turn(self) -> Sequence[int]:
        """The claims (a queue's, a limited name's) starting after the one served last: one
        busy queue or name starves none."""
        n, start = len(self._claims), self._next_queue
        return [(start + i) % n for i in range(n)]

    def _room(self, queue: str, limit: int) -> int:
        cap = self.queue_limits.get(queue)
        return limit if cap is None else min(limit, cap - self._held_count[queue])

    def _took(self, i: int, claim: Claim[ClaimedTask]) -> Claim[ClaimedTask]:
        queue = self._claims[i].queue
        self._next_queue = (i + 1) % len(self._claims)
        held = self._held
        for task_id in claim.ids:
            held[task_id] = queue
        if queue in self.queue_limits:
            self._held_count[queue] += len(claim.ids)
        return claim

    def _let_go(self, ids: Sequence[int]) -> None:
        """These tasks are no longer held (idempotent): room for a claim that passed."""
        freed = False
        held, limits = self._held, self.queue_limits
        for task_id in ids:
            queue = held.pop(task_id, None)
            if queue is not None:
                freed = True
                if queue in limits:
                    self._held_count[queue] -= 1
            if task_id == self._alone:
                self._alone = None
        if freed and self._passed and (not self._suspects or not held):
            self._passed = False
            self.wake_later()

    def wake_later(self) -> None:
        if self.on_free is not None:
            self.on_free()

    # -- the rest of the queue store: the backend's, with the held tasks let go -----------

    async def start(self) -> StoreInfo:
        return await self.store.start()

    async def settle(self, claim: Claim[ClaimedTask], decisions: Sequence[Decision]) -> Settled:
        try:
            return await self.store.settle(claim, decisions)
        finally:
            self._let_go(claim.ids)

    async def extend_leases(self, claim: Claim[ClaimedTask], lease: float) -> int:
        return await self.store.extend_leases(claim, lease)

    async def release(self, claim: Claim[ClaimedTask]) -> int:
        try:
            return await self.store.release(claim)
        finally:
            self._let_go(claim.ids)

    async def hasten(self, ids: Sequence[int]) -> int:
        return await self.store.hasten(ids)

    async def close_gate(self) -> bool:
        return await self.store.close_gate()

    async def open_gate(self) -> None:
        await self.store.open_gate()

    @property
    def gate_closed(self) -> bool:
        return self.store.gate_closed

    @property
    def can_listen(self) -> bool:
        return self.store.can_listen

    async def listen(self, wake: Callable[[], None]) -> None:
        await self.store.listen(wake)

    async def close(self) -> None:
        await self.store.close()
