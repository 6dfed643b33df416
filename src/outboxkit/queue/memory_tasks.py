"""The in-memory task store: the task-store port (queue/tasks.py) with no database.

For the core's tests and users' tests of their handlers: every rule of PostgreSQL's task
claim and settle (``backends/postgres/tasks_sql.py``) is done here on a dict, under the same
names, and both pass one contract suite (``tests/contract/test_task_store.py``). Time is a
clock the test may move (:class:`~outboxkit.queue.memory.ManualClock`). What it does not do:
wake-ups (a worker on it polls) and task lifecycle events (they are outbox rows).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import orjson

from outboxkit.queue.settle import group_decisions
from outboxkit.queue.store import Claim, Decision, Settled, StoreInfo, Verdict
from outboxkit.queue.tasks import (
    FAIR_SHARE,
    PARK_BATCH,
    SUSPECT_LAPSES,
    ClaimedTask,
    LimitsSeen,
    Retention,
    TaskClaim,
    TaskClaimed,
    TaskStatus,
)

__all__ = ["MemoryTaskRow", "MemoryTaskStore", "MemoryTasks"]

#: The crash-loop guard's error (backends/postgres/tasks_sql.py CLAIM), word for word.
_CRASH_LOOP = (
    "worker: claimed {attempts} times without finishing (each worker died or hung running"
    " it): dead-lettered unread; see `outboxkit tasks failed`, then replay or discard it"
)
_UNHANDLED = (
    "no worker with a handler for task {name} claimed it within {grace} s of its due time:"
    " deploy a worker whose --app registers it, then `outboxkit tasks replay`"
)


@dataclasses.dataclass(slots=True)
class MemoryTaskRow:
    """One task, with the columns of PostgreSQL's task table that the rules read."""

    id: int
    task_name: str
    queue: str
    payload: Any
    priority: int
    key: str | None
    max_attempts: int | None
    available_at: float
    created_at: dt.datetime
    status: TaskStatus = TaskStatus.PENDING
    attempts: int = 0
    lapses: int = 0
    spared: int = 0
    claim_token: uuid.UUID | None = None
    claimed_by: str | None = None
    last_error: str | None = None
    error_type: str | None = None
    traceback: str | None = None
    finished_at: float | None = None
    result: str | None = None
    progress: str | None = None
    keep_until: float | None = None
    has_dependents: bool = False
    after_failure: int | None = None

    @property
    def live(self) -> bool:
        return self.status in (TaskStatus.PENDING, TaskStatus.RUNNING)


class MemoryTasks:
    """The task table: rows by id, shared by every store (worker) claiming from it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._rows: dict[int, MemoryTaskRow] = {}
        self._next_id = 1
        #: Dependency edges: a task's upstream task ids.
        self.upstream: dict[int, list[int]] = {}
        #: Rate-limited names' token buckets: name -> (tokens, as of this clock reading).
        self.buckets: dict[str, tuple[float, float]] = {}
        #: Names rate-limited per key: (name, key) -> (tokens, as of this clock reading,
        #: rate, burst).
        self.key_buckets: dict[tuple[str, str], tuple[float, float, float, float]] = {}
        #: The fair names and their share, as the workers told them (tasks_sql.py TELL_FAIR).
        self.fair_shares: dict[str, int] = {}

    def enqueue(
        self,
        task_name: str,
        payload: Any = None,
        *,
        queue: str = "default",
        priority: int = 0,
        key: str | None = None,
        max_attempts: int | None = None,
        delay: float = 0.0,
        after: Sequence[int] = (),
        after_failure: int = 0,
    ) -> int:
        """Add a pending task due after ``delay`` seconds (waiting while ``after`` has an
        unfinished task: tasks_sql.py ENQUEUE_AFTER); its id."""
        upstream = sorted(set(after))
        missing = [i for i in upstream if i not in self._rows]
        if missing:
            raise KeyError(f"no upstream task {missing}")
        task_id, self._next_id = self._next_id, self._next_id + 1
        row = MemoryTaskRow(
            task_id, task_name, queue, payload, priority, key, max_attempts,
            self.clock() + delay, dt.datetime.now(dt.UTC),
        )  # fmt: skip
        if key is not None:  # behind a task of its key: waits for its turn (_KEY_STATUS)
            mine = [r for r in self._rows.values() if r.key == key]
            share = self.fair_shares.get(task_name)
            if any(r.status is TaskStatus.WAITING and r.after_failure is None for r in mine) or (
                any(r.live for r in mine)
                and (share is None or sum(r.status is TaskStatus.PENDING for r in mine) >= share)
            ):  # (a fair name's: pending at once while its key has room and none waits)
                row.status = TaskStatus.WAITING
        if upstream:
            for i in upstream:
                self._rows[i].has_dependents = True
            row.after_failure = after_failure
            if any(self._rows[i].status is not TaskStatus.DONE for i in upstream):
                row.status = TaskStatus.WAITING
            self.upstream[task_id] = upstream
        self._rows[task_id] = row
        return task_id

    def row(self, task_id: int) -> MemoryTaskRow | None:
        return self._rows.get(task_id)

    def rows(self) -> list[MemoryTaskRow]:
        return [self._rows[i] for i in sorted(self._rows)]

    def delete(self, task_id: int) -> None:
        del self._rows[task_id]


class _Transaction:
    """``ctx.transaction()``'s connection here: the completion applies on commit only."""

    def __init__(self, store: MemoryTaskStore) -> None:
        self._store = store
        self._staged: list[tuple[int, uuid.UUID, float | None, str | None]] = []

    def commit(self) -> None:
        for task_id, token, keep, progress in self._staged:
            self._store._finish(task_id, token, keep, progress=progress)
        self._staged = []

    def rollback(self) -> None:
        self._staged = []


class _AsyncTransaction(_Transaction):
    """``ctx.atransaction()``'s: awaitable commit and rollback, as an async connection's."""

    async def commit(self) -> None:  # type: ignore[override]
        super().commit()

    async def rollback(self) -> None:  # type: ignore[override]
        super().rollback()


class MemoryTaskStore:
    """A worker's view of :class:`MemoryTasks` (queues, handled names, retention)."""

    def __init__(
        self,
        tasks: MemoryTasks,
        *,
        queues: Sequence[str] = ("default",),
        names: Sequence[str] | None = None,
        retention: Retention = "delete",
        per_key: Mapping[str, int] | None = None,
        fair: Sequence[str] = (),
        fair_share: int = FAIR_SHARE,
    ) -> None:
        self.tasks = tasks
        #: Task name -> how many of its tasks of one key run at once (others: 1).
        self.per_key = {n: k for n, k in (per_key or {}).items() if k > 1}
        #: Names whose keys are served in turn: FAIR_SHARE of a key pending at once.
        self.fair, self.fair_share = set(fair), fair_share
        self.queues = list(queues)
        self.names = None if names is None else set(names)
        self.retention: Retention = retention
        #: The names its claims limit and those they do not (the sweep's parking).
        self.limits_seen = LimitsSeen()

    def __repr__(self) -> str:
        return f"MemoryTaskStore(queues={self.queues!r})"

    async def start(self) -> StoreInfo:
        now = self.tasks.clock()
        pending = sum(
            1 for r in self.tasks.rows()
            if r.status is TaskStatus.PENDING and r.available_at <= now
        )  # fmt: skip
        return StoreInfo(pending, where="memory")

    # -- the claim (tasks_sql.py CLAIM) ----------------------------------------------------

    def _claimable(
        self, row: MemoryTaskRow, queue: str, now: float, per_key: int = 1, fair: bool = False
    ) -> bool:
        if not row.live or row.available_at > now or row.queue != queue:
            return False
        if self.names is not None and row.task_name not in self.names:
            return False
        return (
            row.key is None
            or fair
            or sum(1 for e in self.tasks.rows() if e.key == row.key and e.id < row.id and e.live)
            < per_key
        )  # (its key's first `per_key` live tasks: tasks_sql.py _KEY_TURN)

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
        now = self.tasks.clock()
        self.limits_seen.learn(what, self.names)
        self._tell_fair()
        if what.concurrency is not None:  # a limited name: its running tasks are its slots
            running = sum(
                1 for r in self.tasks.rows()
                if r.task_name == what.name and r.status is TaskStatus.RUNNING
                and r.available_at > now
            )  # fmt: skip
            limit = max(0, min(limit, what.concurrency - running))
        tokens = 0.0
        if what.rate is not None and what.name is not None:  # a token per task started
            tokens, at = self.tasks.buckets.get(what.name, (float(what.burst), now))
            tokens = min(float(what.burst), tokens + (now - at) * what.rate)
            limit = max(0, min(limit, int(tokens)))
        key_tokens: dict[str, float] = {}  # a key's bucket, refilled (rate_per_key)
        seen = []
        for row in self.tasks.rows():
            if not self._claimable(row, what.queue, now, what.per_key, what.fair is not None):
                continue
            if row.task_name in what.skip or what.name not in (None, row.task_name):
                continue
            running = row.status is TaskStatus.RUNNING
            if what.alone and row.lapses + running < SUSPECT_LAPSES:
                continue
            if what.key_rate is not None and what.name is not None and row.key is not None:
                full = (what.key_burst, now, what.key_rate, what.key_burst)
                held, at, _, _ = self.tasks.key_buckets.get((what.name, row.key), full)
                key_tokens[row.key] = min(float(what.key_burst), held + (now - at) * what.key_rate)
                if key_tokens[row.key] < 1:
                    continue  # its key's bucket is empty: it waits, no attempt spent
            seen.append(row)
        seen.sort(key=lambda r: (-r.priority, r.available_at, r.id))
        seen = seen[:limit]
        over: set[int] = set()  # beyond their key's tokens in this claim (oldest first)
        turns: Counter[str] = Counter()
        for row in sorted(seen, key=lambda r: r.id):
            ambiguous = row.status is TaskStatus.RUNNING and row.lapses < SUSPECT_LAPSES
            if row.key in key_tokens and (row.lapses + ambiguous >= SUSPECT_LAPSES) == what.alone:
                turns[row.key] += 1
                if turns[row.key] > int(key_tokens[row.key]):
                    over.add(row.id)
        suspects = False
        live: list[ClaimedTask] = []
        dead: list[tuple[ClaimedTask, str, str]] = []
        for row in seen:
            ambiguous = row.status is TaskStatus.RUNNING and row.lapses < SUSPECT_LAPSES
            lapses = row.lapses + ambiguous
            if (lapses >= SUSPECT_LAPSES) != what.alone:
                suspects = True
                continue
            if row.id in over:
                continue
            cap = row.max_attempts if row.max_attempts is not None else max_attempts
            row.lapses = lapses
            if not ambiguous and row.attempts - row.spared >= cap:
                row.status, row.claim_token, row.claimed_by = TaskStatus.FAILED, None, owner
                row.finished_at, row.error_type = now, "CrashLoop"
                row.last_error = _CRASH_LOOP.format(attempts=row.attempts)
                dead.append((self._claimed(row), "crash_loop", row.last_error))
                continue
            row.attempts += 1
            row.spared += ambiguous
            row.status, row.available_at = TaskStatus.RUNNING, now + lease
            row.claim_token, row.claimed_by = token, owner
            live.append(self._claimed(row))
        if what.rate is not None and what.name is not None:
            self.tasks.buckets[what.name] = (tokens - len(live), now)
        if what.name is not None:
            for key, started in Counter(t.key for t in live if t.key in key_tokens).items():
                assert key is not None
                self.tasks.key_buckets[what.name, key] = (
                    key_tokens[key] - started,
                    now,
                    what.key_rate or 0.0,
                    float(what.key_burst),
                )
        if what.concurrency is not None and what.name is not None and (live or dead):
            self._promote_parked(what.name, what.queue, len(live) + len(dead))
        more = False
        if what.per_key > 1 or what.fair is not None:  # room for the next ones of these keys
            promoted = self._promote({t.key for t in live if t.key is not None})
            more = promoted > 0 and what.fair is not None
        if not live and not dead:
            return TaskClaimed(None, suspects)
        live.sort(key=lambda t: (-t.priority, t.id))  # the order a worker starts them in
        return TaskClaimed(Claim(token, [t.id for t in live], live, dead), suspects, more)

    def _tell_fair(self) -> None:
        """Its fair names and share for the enqueue, the names it handles without fair=
        forgotten (TELL_FAIR; a dict write, so at every claim)."""
        for name in self.names or ():
            if name not in self.fair:
                self.tasks.fair_shares.pop(name, None)
        for name in self.fair:
            self.tasks.fair_shares[name] = self.fair_share

    # -- tasks parked behind a full concurrency limit (tasks_sql.py PARK_NAME) ------------

    @staticmethod
    def parked(row: MemoryTaskRow) -> bool:
        """Waiting behind its name's full limit: no key, no upstream tasks."""
        return row.status is TaskStatus.WAITING and row.key is None and row.after_failure is None

    def _promote_parked(self, name: str, queue: str, count: int) -> int:
        """The first ``count`` parked tasks of ``name`` in ``queue`` that are due, in the
        claim's order, pending again (PROMOTE_NAME)."""
        now = self.tasks.clock()
        due = sorted(
            (r for r in self.tasks.rows()
             if self.parked(r) and r.task_name == name and r.queue == queue
             and r.available_at <= now),
            key=lambda r: (-r.priority, r.available_at, r.id),
        )[:count]  # fmt: skip
        for row in due:
            row.status = TaskStatus.PENDING
        return len(due)

    def _park(self, limit: int) -> int:
        """The sweep's side: each limited name's first N due parked tasks promoted, then
        its pending unkeyed tasks beyond the first N (due first) parked, PARK_BATCH times
        ``limit`` at most; parked tasks of a
        name claimed without a limit promoted. How many it moved for good (a full batch:
        ``limit``)."""
        now, moved = self.tasks.clock(), 0
        for (name, queue), keep in sorted(self.limits_seen.limits.items()):
            self._promote_parked(name, queue, keep)
            pending = sorted(
                (r for r in self.tasks.rows()
                 if r.status is TaskStatus.PENDING and r.task_name == name and r.queue == queue
                 and r.key is None and r.after_failure is None),
                key=lambda r: (r.available_at > now, -r.priority, r.available_at, r.id),
            )  # fmt: skip
            batch = PARK_BATCH * limit + keep
            for row in pending[keep : keep + batch]:
                row.status = TaskStatus.WAITING
            moved += limit if len(pending) >= keep + batch else 0
        for row in self.tasks.rows():
            if moved >= limit:
                break
            if self.parked(row) and row.task_name in self.limits_seen.unlimited:
                row.status, moved = TaskStatus.PENDING, moved + 1
        return moved

    @staticmethod
    def _claimed(row: MemoryTaskRow) -> ClaimedTask:
        return ClaimedTask(
            row.id, row.task_name, row.queue, row.payload, row.attempts, row.max_attempts,
            row.key, row.priority, row.created_at, row.spared,
            has_dependents=row.has_dependents,
        )  # fmt: skip

    # -- settle, heartbeat, release: each fenced by the claim token -------------------------

    def _held(self, task_id: int, token: uuid.UUID) -> MemoryTaskRow | None:
        row = self.tasks.row(task_id)
        return row if row is not None and row.claim_token == token else None

    def _finish(
        self,
        task_id: int,
        token: uuid.UUID,
        keep: float | None = None,
        result: str | None = None,
        progress: str | None = None,
    ) -> bool:
        row = self._held(task_id, token)
        if row is None:
            return False
        if self.retention == "delete" and keep is None:
            self.tasks.delete(task_id)
        else:
            row.status, row.claim_token = TaskStatus.DONE, None
            row.finished_at = self.tasks.clock()
            if keep is not None:
                row.result, row.keep_until = result, row.finished_at + keep
                row.progress = progress if progress is not None else row.progress
        return True

    async def settle(self, claim: Claim[ClaimedTask], decisions: Sequence[Decision]) -> Settled:
        settled = [i for i, t in zip(claim.ids, claim.items, strict=True) if t.completed]
        for task in claim.items:  # completed in their own transaction: the value follows
            row = self.tasks.row(task.id)
            if (
                task.completed and task.keep is not None and row is not None
                and row.status is TaskStatus.DONE and row.attempts == task.attempt
                and row.result is None
            ):  # fmt: skip
                row.result = task.result
        left = [k for k, t in enumerate(claim.items) if not t.completed]
        rest = Claim(claim.token, [claim.ids[k] for k in left], [claim.items[k] for k in left])
        groups = group_decisions(rest, [decisions[k] for k in left], unknown=None)
        task_of = dict(zip(rest.ids, rest.items, strict=True))
        settled += [
            i for i in groups.done
            if self._finish(i, claim.token, task_of[i].keep, task_of[i].result,
                            task_of[i].progress)
        ]  # fmt: skip
        now = self.tasks.clock()
        for task_id, dead, delay, error, refund in groups.failures():
            row = self._held(task_id, claim.token)
            if row is None:
                continue
            task = task_of[task_id]
            row.status = TaskStatus.FAILED if dead else TaskStatus.PENDING
            row.available_at = now + delay
            row.last_error = error if error is not None else row.last_error
            row.error_type = task.error_type or row.error_type
            row.traceback = task.traceback or row.traceback
            row.claim_token = None
            row.attempts = max(row.attempts - refund, 0)
            row.lapses = row.lapses if refund else 0
            row.finished_at = now if dead else None
            settled.append(task_id)
        upstream = [t.id for t in claim.items if t.has_dependents and t.id in settled]
        if upstream:
            await self.release_dependents(upstream, 1000)
        ended = {
            t.key for t, d in zip(claim.items, decisions, strict=True)
            if t.key is not None and t.id in settled and d.verdict in (Verdict.DONE, Verdict.DEAD)
        }  # fmt: skip
        self._promote(ended)
        return Settled(settled, len(claim.ids) - len(settled))

    def _promote(self, keys: set[str], *, sweep: bool = False) -> int:
        """The next waiting tasks of each key while it has room (tasks_sql.py PROMOTE_KEYS;
        ``sweep``: only keys whose first waiting task has room, as SWEEP_KEYS)."""
        moved, now = 0, self.tasks.clock()
        for key in sorted(keys):
            rows = [r for r in self.tasks.rows() if r.key == key]
            live = sum(1 for r in rows if r.live)
            pending = sum(1 for r in rows if r.status is TaskStatus.PENDING)
            waiting = [r for r in rows
                       if r.status is TaskStatus.WAITING and r.after_failure is None]  # fmt: skip

            def room(
                row: MemoryTaskRow, turn: int, live: int = live, pending: int = pending
            ) -> bool:
                if row.task_name in self.fair:  # a fair name: its key's pending ones count
                    return pending + turn <= self.fair_share
                return live + turn <= self.per_key.get(row.task_name, 1)

            if sweep and waiting and not room(waiting[0], 1):
                continue
            for turn, row in enumerate(waiting, 1):
                if room(row, turn):
                    row.status, moved = TaskStatus.PENDING, moved + 1
                    if row.task_name in self.fair and (pending or turn > 1):
                        row.available_at = max(row.available_at, now)  # behind those due
        return moved

    async def progress(self, updates: Sequence[tuple[int, uuid.UUID, str]]) -> int:
        written = 0
        for task_id, token, value in updates:
            row = self._held(task_id, token)
            if row is not None and row.status is TaskStatus.RUNNING:
                row.progress, written = value, written + 1
        return written

    async def release_dependents(self, ids: Sequence[int] | None, limit: int) -> int:
        chosen = set(ids) if ids is not None else None
        moved = 0
        if ids is None:  # the sweep: tasks parked behind a limit, in and out
            moved += self._park(limit)
        if ids is None:  # the sweep: keys whose next task nobody promoted too
            moved += self._promote({
                r.key for r in self.tasks.rows()
                if r.key is not None and r.status is TaskStatus.WAITING and r.after_failure is None
            }, sweep=True)  # fmt: skip
        for row in self.tasks.rows():
            if moved >= limit:
                break
            upstream = self.tasks.upstream.get(row.id, [])
            if (
                row.status is not TaskStatus.WAITING
                or row.after_failure is None
                or (chosen is not None and not chosen.intersection(upstream))
            ):
                continue
            states = [u.status if (u := self.tasks.row(i)) else TaskStatus.DONE for i in upstream]
            bad = [i for i, s in zip(upstream, states, strict=True)
                   if s in (TaskStatus.FAILED, TaskStatus.CANCELLED)]  # fmt: skip
            waiting = (TaskStatus.PENDING, TaskStatus.RUNNING, TaskStatus.WAITING)
            live = [s for s in states if s in waiting]
            if bad and row.after_failure == 0:
                row.status, row.finished_at = TaskStatus.CANCELLED, self.tasks.clock()
                row.error_type = "UpstreamFailed"
                row.last_error = (
                    f"upstream task {bad[0]} failed or was cancelled, so this task was"
                    ' cancelled (after_failure="cancel")'
                )
            elif not live:
                row.status = TaskStatus.PENDING
            else:
                continue
            moved += 1
        return moved

    def dependencies(self, conn: Any, task_id: int) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for i in self.tasks.upstream.get(task_id, []):
            u = self.tasks.row(i)
            found.append({"after_id": i, "id": None} if u is None else {
                "after_id": i, "id": u.id, "task_name": u.task_name, "status": int(u.status),
                "later": False, "result": None if u.result is None else orjson.loads(u.result),
                "last_error": u.last_error, "error_type": u.error_type,
                "traceback_excerpt": u.traceback, "attempts": u.attempts,
                "progress": None if u.progress is None else orjson.loads(u.progress),
                "created_at": u.created_at, "started_at": None, "finished_at": None,
            })  # fmt: skip
        return found

    async def adependencies(self, conn: Any, task_id: int) -> list[dict[str, Any]]:
        return self.dependencies(conn, task_id)

    async def purge_kept(self, limit: int) -> int:
        now = self.tasks.clock()
        gone = [
            r.id for r in self.tasks.rows()
            if r.keep_until is not None and r.keep_until < now
            and r.status in (TaskStatus.DONE, TaskStatus.CANCELLED)
        ][:limit]  # fmt: skip
        for task_id in gone:
            self.tasks.delete(task_id)
        for task_id in [i for i in self.tasks.upstream if self.tasks.row(i) is None][:limit]:
            del self.tasks.upstream[task_id]
        buckets = self.tasks.key_buckets  # refilled: the same as no bucket (PRUNE_KEY_RATES)
        full = [k for k, (tokens, at, rate, burst) in buckets.items()
                if tokens + (now - at) * rate >= burst][:limit]  # fmt: skip
        for bucket in full:
            del buckets[bucket]
        return max(len(gone), len(full))

    async def extend_leases(self, claim: Claim[ClaimedTask], lease: float) -> int:
        held = 0
        for task_id in claim.ids:
            row = self._held(task_id, claim.token)
            now = self.tasks.clock()
            if row is not None and row.status is TaskStatus.RUNNING and row.available_at > now:
                row.available_at = now + lease  # (a lapsed lease stays lapsed)
                held += 1
        return held

    async def release(self, claim: Claim[ClaimedTask]) -> int:
        released = 0
        for task_id, task in zip(claim.ids, claim.items, strict=True):
            row = None if task.completed else self._held(task_id, claim.token)
            if row is not None:
                row.status, row.available_at = TaskStatus.PENDING, self.tasks.clock()
                row.claim_token, row.attempts = None, max(row.attempts - 1, 0)
                released += 1
        return released

    async def hasten(self, ids: Sequence[int]) -> int:
        now, changed = self.tasks.clock(), 0
        for task_id in ids:
            row = self.tasks.row(task_id)
            if (
                row is not None and row.status is TaskStatus.PENDING
                and row.claim_token is None and row.available_at > now
            ):  # fmt: skip
                row.available_at, changed = now, changed + 1
        return changed

    async def fail_unhandled(self, grace: float, limit: int) -> list[str]:
        now, failed = self.tasks.clock(), list[str]()
        for row in self.tasks.rows():
            if len(failed) >= limit:
                break
            if (
                row.status is TaskStatus.PENDING and row.queue in self.queues
                and row.available_at < now - grace
                and row.task_name not in (self.names or ())
            ):  # fmt: skip
                row.status, row.finished_at, row.claim_token = TaskStatus.FAILED, now, None
                row.error_type = "UnknownTask"
                row.last_error = _UNHANDLED.format(name=row.task_name, grace=grace)
                failed.append(row.task_name)
        return failed

    # -- a handler's own transaction --------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self, label: str) -> Iterator[_Transaction]:
        yield _Transaction(self)

    @contextlib.asynccontextmanager
    async def atransaction(self, label: str) -> AsyncIterator[_AsyncTransaction]:
        yield _AsyncTransaction(self)

    def complete(
        self,
        conn: _Transaction,
        task_id: int,
        token: uuid.UUID,
        keep: float | None = None,
        progress: str | None = None,
    ) -> bool:
        if self._held(task_id, token) is None:
            return False
        conn._staged.append((task_id, token, keep, progress))
        return True

    async def acomplete(
        self,
        conn: _Transaction,
        task_id: int,
        token: uuid.UUID,
        keep: float | None = None,
        progress: str | None = None,
    ) -> bool:
        return self.complete(conn, task_id, token, keep, progress)

    # -- no wake-ups: a worker on memory polls -----------------------------------------------

    async def close_gate(self) -> bool:
        return False

    async def open_gate(self) -> None:
        return None

    @property
    def gate_closed(self) -> bool:
        return False

    @property
    def can_listen(self) -> bool:
        return False

    async def listen(self, wake: Callable[[], None]) -> None:
        """No wake-ups ever (``can_listen`` is False): waits until cancelled."""
        await asyncio.Event().wait()

    async def close(self) -> None:
        return None
