"""The task-store port: what task mode (outboxkit.tasks) asks of a backend's task table.

Task mode talks to this port only; a backend implements it (PostgreSQL's
``backends/postgres/tasks_pg.py``, the in-memory ``queue/memory_tasks.py``) and passes one
contract suite (``tests/contract/test_task_store.py``). What to claim is decided in the core
(``queue/task_claims.py``: the queues in turn, per-queue limits, suspects run alone) and
handed to the backend as a :class:`TaskClaim`; the backend only carries it out in one
statement. The rules every backend keeps, beside the queue store's (``queue/store.py``):

* a task is claimable when it is pending and due, or running with its lease run out (its
  worker died or froze); a keyed task only in its key's turn (below);
* a limited name (:attr:`TaskClaim.concurrency`) never has more tasks running with an
  unlapsed lease than its limit, whatever claims race; a lapsed lease is never extended;
* a rate-limited name (:attr:`TaskClaim.rate`) starts no more tasks than its bucket holds
  tokens; a task it holds back stays pending (no attempt spent); likewise a name
  rate-limited per key (:attr:`TaskClaim.key_rate`), with a bucket per key;
* a keyed task is claimable only while fewer than :attr:`TaskClaim.per_key` earlier tasks of
  its key are live (1: its key's head alone): a key's first N live tasks run, in id order;
  a keyed task enqueued behind a live one waits, and a settle or claim of a keyed task (and
  the sweep) makes the next ones pending up to their name's ``per_key`` (the store's map);
* a keyed task of a fair name (:attr:`TaskClaim.fair`, the store's ``fair`` map) is
  claimable whatever runs of its key, but at most :data:`FAIR_SHARE` of a key are pending
  at once: the rest wait, and a promotion makes the next ones pending behind every task
  already due (its ``available_at`` moved to the promotion's clock; its key's only pending
  one keeps its place), so a claim ordered by time sees at most that many of any one key
  ahead of another key's task;
* every claim is a new attempt (``attempt`` numbers one per claim), but a lapsed task's
  death is charged against max_attempts only when its claim ran it **alone**: a worker
  whose process dies takes every task it ran with it, and only the one that killed it
  deserves the charge. A lapse of a task claimed beside others is ambiguous: that attempt
  is ``spared``, and after :data:`SUSPECT_LAPSES` such lapses in a row the task is a
  *suspect*, claimed only alone (:attr:`TaskClaim.alone`). The crash-loop guard
  dead-letters a task whose charged attempts (``attempts - spared``) reached max_attempts;
* completing a task inside the handler's own transaction is fenced by the claim token,
  as every settle is;
* a task whose handler keeps results (``ClaimedTask.keep``) stays done with its value
  (``ClaimedTask.result``) for ``keep`` seconds, stored by its fenced completion (a task
  completed in its own transaction gets the value right after, by the attempt that
  completed it); progress is written fenced by the claim token too, so a zombie attempt
  can record neither.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal, Protocol

from outboxkit.errors import TaskNotFound
from outboxkit.queue.store import Claim, Decision, Settled, StoreInfo

__all__ = [
    "DEFAULT_MAX_TASK_NAMES",
    "DEFAULT_TASKS_TABLE",
    "FAIR_SHARE",
    "OTHER_TASKS",
    "SUSPECT_LAPSES",
    "ClaimedTask",
    "Retention",
    "Schedules",
    "SettleHook",
    "TaskClaim",
    "TaskClaimed",
    "TaskStatus",
    "TaskStore",
    "UndecodablePayload",
    "task_finished",
    "task_gone",
    "task_late",
]

#: The task table every API and command uses unless given another.
DEFAULT_TASKS_TABLE = "outboxkit_tasks"
#: Task names with gauges of their own by default; the others are summed as OTHER_TASKS.
DEFAULT_MAX_TASK_NAMES = 100
#: The name every task outside the named set is counted under (the outbox's "(other)").
OTHER_TASKS = "(other)"
#: A fair name's tasks of one key claimable at once (``fair=True``): another key's task
#: waits behind at most this many of each key. About one claim of a worker at its defaults
#: (10 slots and up to 100 prefetched), so a key alone still fills a whole claim.
FAIR_SHARE = 100
#: The workers' sweep parks up to this many times its batch of the tasks behind a full
#: concurrency limit at once (a flood of 100 000 parked in about 2 s on PostgreSQL: 10 000
#: a statement took 0.2 s, each sorting the name's pending tasks).
PARK_BATCH = 10


class TaskStatus(IntEnum):
    """A task's state, as every backend stores it in ``status``. A running task's
    ``available_at`` is its lease."""

    PENDING = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4
    #: Waiting for its upstream tasks (``after=``) or its key's turn; never claimed.
    WAITING = 5


#: Ambiguous lapses in a row (the task's worker died while it ran beside others) after
#: which a task runs only alone, so that its next death is known to be its own.
SUSPECT_LAPSES = 2

Retention = Literal["delete", "keep"]


@dataclass(slots=True, eq=False)
class ClaimedTask:
    """One claimed task, as the worker's handler sink gets it (the claim's RETURNING order).

    The sink fills ``error_type`` and ``traceback`` when the handler fails (stored with the
    settle), and ``completed`` when ``ctx.transaction()`` completed the task in the
    handler's own transaction (the settle then has nothing left to do for it).
    """

    id: int
    task_name: str
    queue: str
    payload: Any
    attempt: int
    max_attempts: int | None
    key: str | None
    priority: int
    created_at: dt.datetime
    #: Attempts of this task not charged against max_attempts: its worker died while it
    #: ran beside others, so the death was not known to be its own.
    spared: int = 0
    error_type: str | None = None
    traceback: str | None = None
    completed: bool = False
    #: Seconds the finished task is kept for its result (its handler's ``keep_result``),
    #: None: its handler keeps none. Set by the sink before the handler runs.
    keep: float | None = None
    #: The handler's return value as JSON text, stored with the completion when ``keep``.
    result: str | None = None
    #: Its last progress not written yet (JSON text), written with a kept completion.
    progress: str | None = None
    #: Tasks wait for this one (``after=``): its settle releases them.
    has_dependents: bool = False
    #: The W3C traceparent active when it was enqueued (None: no span was).
    trace: str | None = None


@dataclass(frozen=True, slots=True)
class UndecodablePayload:
    """A claimed task's payload that does not decode (a row written around ``enqueue``, such
    as JSON nested past orjson's depth limit): the handler sink fails that task alone."""

    reason: str


@dataclass(frozen=True, slots=True)
class TaskClaim:
    """What one claim takes, as the core decided it (``queue/task_claims.py``).

    ``queue``: the one queue it claims from (of the task names the store was made for).
    ``alone``: a suspect run: the claim takes suspects only, and the worker runs what it
    claims alone (nothing else running, nothing claimed until it settles), so a death while
    it runs is charged to it. A claim that is not alone never takes a suspect and reports
    that it passed one (:attr:`TaskClaimed.suspects`).
    ``name`` and ``concurrency``: a limited task name's claim: only tasks of ``name``, and
    at most ``concurrency`` of them running at once across every worker, counted by the
    store from its running tasks whose lease has not lapsed (their claims serialize on the
    name, so two never fill one slot). ``skip``: task names this claim never takes (the
    limited ones, claimed by their own claims).
    ``rate`` and ``burst``: a rate-limited name's claim: starts of ``name`` across every
    worker at most ``rate`` per second, from a token bucket in the store (refilled by its
    clock, holding at most ``burst`` tokens); a claim takes one token per task.
    ``per_key``: a keyed task of this claim runs only while fewer than this many earlier
    tasks of its key are live (pending or running), so at most this many of a key run at
    once, in id order (1: serial per key; more: the name's own claim).
    ``key_rate`` and ``key_burst``: starts of ``name``'s tasks of one key at most
    ``key_rate`` per second across every worker, from a token bucket per (name, key) in the
    store; unkeyed tasks are not limited by it.
    ``fair``: a fair name's claim (``fair=True``): its keyed tasks are claimable however
    many of their key run, and the store keeps at most this many of a key pending, each
    promoted one behind the tasks already due (no key holds another back by more than that).
    """

    queue: str
    alone: bool = False
    name: str | None = None
    concurrency: int | None = None
    skip: tuple[str, ...] = ()
    rate: float | None = None
    burst: int = 1
    per_key: int = 1
    key_rate: float | None = None
    key_burst: int = 1
    fair: int | None = None


@dataclass(slots=True)
class LimitsSeen:
    """A store's view of which names its worker claims with a concurrency limit
    (``(name, queue)`` -> N: the sweep parks their tasks beyond the best N) and which
    without one (their parked tasks, from a deploy that had the limit, are promoted), as
    its claims say: no port change, the claims are what every worker sends."""

    limits: dict[tuple[str, str], int] = field(default_factory=dict)
    unlimited: set[str] = field(default_factory=set)

    def learn(self, what: TaskClaim, names: Iterable[str] | None) -> None:
        """From one claim; ``names``: the names the store claims (None: any)."""
        if what.name is not None and what.concurrency is not None:
            self.limits[what.name, what.queue] = what.concurrency
            self.unlimited.discard(what.name)
        elif what.name is not None:
            self.unlimited.add(what.name)
        elif names is not None:
            self.unlimited.update(n for n in names if n not in what.skip)


@dataclass(slots=True)
class TaskClaimed:
    """A claim's result: the claim (None: nothing claimed nor dead-lettered), whether
    the statement passed over suspects, which wait for a worker to run them alone, and
    whether it made more tasks claimable (a fair key's next ones: claim again at once)."""

    claim: Claim[ClaimedTask] | None
    suspects: bool = False
    more: bool = False


#: Given the tasks a settle changed with their decisions, the statement (``%s`` style) and
#: parameters to run in the same transaction, or None: task lifecycle events (tasks/).
SettleHook = Callable[[Sequence[tuple[ClaimedTask, Decision]]], "tuple[str, Sequence[Any]] | None"]


class Schedules(Protocol):
    """Periodic tasks' slots (tasks/periodic.py): one run per (schedule, slot), by the
    database's clock, whichever worker inserts it first. A failed call raises
    :class:`~outboxkit.queue.store.StoreError` (the driver's error as its ``cause``)."""

    async def now(self) -> dt.datetime:
        """The database's clock (every worker reads the same one)."""
        ...

    async def last_slot(self, schedule: str) -> tuple[dt.datetime | None, dt.datetime]:
        """The latest slot recorded for ``schedule`` (None: never ran), and the clock."""
        ...

    async def enqueue(
        self, schedule: str, slot: dt.datetime, name: str, queue: str, payload: str, priority: int
    ) -> int | None:
        """Insert the slot and its task together; the task id, None if the slot was taken."""
        ...

    async def prune(self, keep: float, limit: int) -> int:
        """Delete up to ``limit`` slots older than ``keep`` seconds (each schedule's newest
        stays); how many."""
        ...

    async def close(self) -> None: ...


class TaskStore(Protocol):
    """A backend's task table, as the worker's core uses it. Every write is fenced.

    Errors as :class:`outboxkit.queue.store.QueueStore`'s. The wake-up methods
    (``close_gate``, ``open_gate``, ``gate_closed``, ``can_listen``, ``listen``) are the
    queue store's, with the same meaning.
    """

    queues: list[str]

    async def start(self) -> StoreInfo: ...

    async def claim_tasks(
        self,
        what: TaskClaim,
        *,
        limit: int,
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
    ) -> TaskClaimed:
        """Lease up to ``limit`` claimable tasks of ``what.queue`` under ``token``."""
        ...

    async def settle(self, claim: Claim[ClaimedTask], decisions: Sequence[Decision]) -> Settled:
        """Apply one decision per task, fenced; tasks ``completed`` in their own transaction
        count as settled (their kept result is written now). A settle resets a task's lapse
        count (it ran to an outcome). A done task that keeps its result stays, with it."""
        ...

    async def progress(self, updates: Sequence[tuple[int, uuid.UUID, str]]) -> int:
        """Write running tasks' progress (id, claim token, JSON text), each fenced by its
        token; how many were written."""
        ...

    async def purge_kept(self, limit: int) -> int:
        """Delete up to ``limit`` finished tasks kept for their results past their time (and
        the dependency edges of tasks that are gone, and up to ``limit`` per-key buckets that
        have refilled: the same as none); the most either deleted."""
        ...

    async def release_dependents(self, ids: Sequence[int] | None, limit: int) -> int:
        """Decide waiting tasks whose upstream tasks finished: pending when all are done (a
        deleted one counts done), cancelled when one failed or was cancelled (unless the task
        runs anyway). ``ids``: only the dependents of these tasks; None: any (the sweep).
        Settles release the dependents of the tasks they finish themselves."""
        ...

    def dependencies(self, conn: Any, task_id: int) -> list[dict[str, Any]]:
        """The upstream tasks of ``task_id`` as ``READ_DEPENDENCIES`` rows (``after_id``
        and the row's columns, None where the upstream task is gone: done and deleted)."""
        ...

    async def adependencies(self, conn: Any, task_id: int) -> list[dict[str, Any]]:
        """The async twin of :meth:`dependencies`."""
        ...

    async def extend_leases(self, claim: Claim[ClaimedTask], lease: float) -> int: ...

    async def release(self, claim: Claim[ClaimedTask]) -> int:
        """Hand the claim's unfinished tasks back at once, attempt refunded (fenced)."""
        ...

    async def hasten(self, ids: Sequence[int]) -> int: ...

    async def fail_unhandled(self, grace: float, limit: int) -> list[str]:
        """Fail due tasks of the store's queues whose names this worker has no handler for
        and no worker claimed within ``grace`` seconds (one batch); the names failed."""
        ...

    def transaction(self, label: str) -> AbstractContextManager[Any]:
        """A new connection in a transaction for a sync handler (``ctx.transaction()``),
        closed (rolled back unless committed) on exit."""
        ...

    def atransaction(self, label: str) -> AbstractAsyncContextManager[Any]:
        """The async twin of :meth:`transaction`."""
        ...

    def complete(
        self,
        conn: Any,
        task_id: int,
        token: uuid.UUID,
        keep: float | None = None,
        progress: str | None = None,
    ) -> bool:
        """Complete the task in ``conn``'s open transaction, fenced by ``token``; False if
        this attempt lost it (the caller rolls the transaction back). ``keep``: the task
        stays done that many seconds (with ``progress``, its last one), its result written
        by the settle."""
        ...

    async def acomplete(
        self,
        conn: Any,
        task_id: int,
        token: uuid.UUID,
        keep: float | None = None,
        progress: str | None = None,
    ) -> bool:
        """The async twin of :meth:`complete`."""
        ...

    async def close_gate(self) -> bool: ...

    async def open_gate(self) -> None: ...

    @property
    def gate_closed(self) -> bool: ...

    @property
    def can_listen(self) -> bool: ...

    async def listen(self, wake: Callable[[], None]) -> None: ...

    async def close(self) -> None: ...


# -- what Tasks.wait() says, on every backend ------------------------------------------------


def task_gone(task_id: int) -> TaskNotFound:
    """The task is not in the table (a wait's or a result's answer)."""
    return TaskNotFound(
        f"no task {task_id} in the table: never enqueued (or not committed yet), finished and"
        " deleted (its handler keeps no result: give it keep_result=True to wait on it), or"
        " discarded"
    )


def task_late(task_id: int, timeout: float, row: dict[str, Any]) -> TimeoutError:
    """A wait ran out: the task's last state (a ``READ_RESULT`` row) in words."""
    code = TaskStatus(int(row["status"]))
    status = code.name.lower()
    if code is TaskStatus.PENDING:
        status = "scheduled" if row["later"] else "queued"
    return TimeoutError(
        f"task {task_id} ({row['task_name']}) did not finish within {timeout:g} s: it is"
        f" {status} after {row['attempts']} attempt(s)"
    )


def task_finished(row: dict[str, Any]) -> bool:
    """Whether a ``READ_RESULT`` row is a finished task (done, failed or cancelled)."""
    return int(row["status"]) in (TaskStatus.DONE, TaskStatus.FAILED, TaskStatus.CANCELLED)
