"""MariaDB's task store: the task-store port (queue/tasks.py) on a MariaDB/MySQL task table.

The rules are PostgreSQL's (backends/postgres/tasks_pg.py), passed by one contract suite
(tests/contract/test_task_store.py); the statements are tasks_sql.py's. Where PostgreSQL
does a step in one statement (a claim's CTEs that lock, lease, dead-letter and return),
MariaDB does it in a few statements of one short READ COMMITTED transaction on the
store's claim or settle connection (session.py). No LISTEN: a worker polls, and enqueues
through outboxkit in its own process wake it (wakeup.py, as the outbox's relay).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import orjson

from outboxkit.backends.mariadb import wakeup
from outboxkit.backends.mariadb.migrate import connect
from outboxkit.backends.mariadb.session import (
    NO_COLUMN,
    NO_INDEX,
    NO_TABLE,
    GatedSession,
    micros,
    quiet_cursor,
)
from outboxkit.backends.mariadb.sql import ids_in, with_ids
from outboxkit.backends.mariadb.tasks_sql import TaskStatements, digests_in
from outboxkit.errors import SchemaError
from outboxkit.queue.group_commit import GroupCommit
from outboxkit.queue.settle import group_decisions
from outboxkit.queue.store import DONE, Claim, Decision, Settled, StoreError, StoreInfo, Verdict
from outboxkit.queue.tasks import (
    FAIR_SHARE,
    SUSPECT_LAPSES,
    ClaimedTask,
    Retention,
    SettleHook,
    TaskClaim,
    TaskClaimed,
    TaskStatus,
    UndecodablePayload,
)

log = logging.getLogger("outboxkit.worker")

#: The start-up count of pending tasks stops here.
PENDING_CAP = 100_000
#: Waiting tasks one release decides at most (a settle's, or the sweep's).
RELEASE_BATCH = 1000


def utc(value: dt.datetime | None) -> dt.datetime | None:
    """A UTC DATETIME(6) read back (naive) as an aware datetime."""
    return None if value is None else value.replace(tzinfo=dt.UTC)


def _payload(text: str) -> Any:
    """Per row, so one undecodable payload fails its task alone (as PostgreSQL's loader)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return UndecodablePayload(str(exc))


def _claimed(row: Sequence[Any]) -> ClaimedTask:
    """A ``claim_read`` row (its error column last) as a ClaimedTask."""
    (task_id, name, queue, payload, attempt, max_attempts, key, priority, created_at,
     spared, has_dependents, trace) = row[:12]  # fmt: skip
    return ClaimedTask(
        task_id, name, queue, _payload(payload), attempt, max_attempts, key, priority,
        utc(created_at) or dt.datetime.now(dt.UTC), spared, has_dependents=bool(has_dependents),
        trace=trace,
    )  # fmt: skip


def result_row(names: Sequence[str], row: Sequence[Any]) -> dict[str, Any]:
    """A ``read_result``/``read_dependencies`` row as PostgreSQL's dict row: JSON decoded,
    times aware, flags as bools."""
    found = dict(zip(names, row, strict=True))
    for column in ("result", "progress"):
        if found.get(column) is not None:
            found[column] = orjson.loads(found[column])
    for column in ("created_at", "started_at", "finished_at"):
        if column in found:
            found[column] = utc(found[column])
    if found.get("later") is not None:
        found["later"] = bool(found["later"])
    return found


async def _insert_events(cur: Any, insert: tuple[str, Sequence[Any]] | None) -> None:
    """The lifecycle events' INSERT (the outbox's, tasks/lifecycle.py) on the store's
    aiomysql cursor. Its values are written into the query as literals: aiomysql 0.3's own
    escaping fails on bytes (the payload) with PyMySQL 1.2. The drivers' aiomysql adapter
    does the same for an outbox write; backends do not import drivers (the layers), and it
    is three lines."""
    if insert is None:
        return
    text, params = insert
    conn = cur.connection
    await cur.execute(text % tuple(_literal(conn, value) for value in params))


def _literal(conn: Any, value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return f"_binary X'{value.hex()}'"
    return str(conn.escape(str(value) if isinstance(value, uuid.UUID) else value))


class MariaDBTaskStore(GatedSession):
    """A MariaDB task table as task mode's store (the port of queue/tasks.py).

    ``queues``: the queues this worker serves; ``names``: the task names it has handlers
    for (it claims only those; None: any). ``retention="delete"`` (default) deletes a
    finished task; ``"keep"`` marks it done. ``per_key``: task name -> its
    ``concurrency_per_key`` above 1 (how many of a key's tasks its promotions make pending;
    every other name's keys run one at a time). ``fair``: the task names with ``fair=True``:
    at most ``fair_share`` of a key pending at once, each promoted behind the tasks already
    due; how many run is not limited.
    ``on_settle``: the lifecycle events' INSERT (tasks/lifecycle.py), run in each settle's
    transaction and in a claim's that dead-letters.
    """

    what = "the worker"

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        queues: Sequence[str] = ("default",),
        retention: Retention = "delete",
        name: str = "outboxkit-worker",
        names: Sequence[str] | None = None,
        per_key: Mapping[str, int] | None = None,
        fair: Sequence[str] = (),
        fair_share: int = FAIR_SHARE,
        on_settle: SettleHook | None = None,
    ) -> None:
        super().__init__(dsn, table)
        self.per_key = {n: k for n, k in (per_key or {}).items() if k > 1}
        self.fair, self.fair_share = sorted(fair), fair_share
        #: Task lifecycle events: written in the settle's own transaction (_events).
        self.on_settle = on_settle
        self.table = table
        self.sql = TaskStatements(table)
        self.queues = list(queues)
        self.names = None if names is None else sorted(names)
        self.retention: Retention = retention
        self.name = name
        self._complete = self.sql.complete_keep if retention == "keep" else self.sql.complete_delete
        #: Plain completions arriving while a group is written go together in the next.
        self._grouped: GroupCommit[tuple[list[int], str]] = GroupCommit(self._settle_done)

    def __repr__(self) -> str:
        return f"MariaDBTaskStore(table={self.table!r}, queues={self.queues!r})"

    def _schema_error(self, code: int, reason: str) -> Exception | None:
        if code in (NO_TABLE, NO_COLUMN, NO_INDEX):
            return SchemaError(
                f"task table {self.table!r} is missing or older than this outboxkit (the server"
                f" says: {reason}): run `outboxkit migrate --tasks --dsn mysql://..."
                f" --tasks-table {self.table}`"
            )
        return None

    async def start(self) -> StoreInfo:
        async def check(cur: Any) -> int:
            await cur.execute(self.sql.count_pending, (PENDING_CAP,))
            (pending,) = await cur.fetchone()
            await cur.execute(self.sql.check_columns)
            await cur.execute(self.sql.check_tables)
            return int(pending)

        pending = await self._run("claim", check)
        where = f"database {self._args['database']} on {self._args['host']} (MariaDB)"
        return StoreInfo(pending, pending >= PENDING_CAP, where)

    # -- the claim ------------------------------------------------------------------------

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
        async def run(cur: Any) -> TaskClaimed:
            await cur.execute("BEGIN")
            found = await self._claim(cur, what, limit, lease, token, owner, max_attempts)
            await self._dead_letter_events(cur, found)
            await cur.execute("COMMIT")
            return found

        found: TaskClaimed = await self._run("claim", run)
        if (what.per_key > 1 or what.fair is not None) and found.claim is not None:
            return await self._make_room(what, found)
        return found

    async def _make_room(self, what: TaskClaim, found: TaskClaimed) -> TaskClaimed:
        """After a claim of a name with N > 1 or a fair one (its COMMIT seen): the next
        waiting tasks of its keys, up to their room; a fair key's: claim again at once."""
        assert found.claim is not None
        keys = sorted({t.key for t in found.claim.items if t.key is not None})
        if not keys:
            return found
        try:
            promoted = await self._promote(keys)
        except StoreError as exc:  # claimed all the same: the sweep promotes them
            log.debug("promoting the next tasks of keys %s failed: %s", keys, exc)
            return found
        more = bool(promoted) and what.fair is not None
        return TaskClaimed(found.claim, found.suspects, more)

    async def _claim(
        self,
        cur: Any,
        what: TaskClaim,
        limit: int,
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
    ) -> TaskClaimed:
        sq = self.sql
        await cur.execute(sq.queue_paused, (what.queue,))
        paused = await cur.fetchone()
        if paused is not None and paused[0]:
            return TaskClaimed(None)
        tokens = 0.0
        limited = (what.concurrency, what.rate, what.key_rate)
        if what.name is not None and any(v is not None for v in limited):
            # The name's row, locked to COMMIT: its claims run one at a time (the count and
            # the bucket below see every claim of the name committed before this one).
            await cur.execute(sq.limit_row, (what.name, float(what.burst)))
            await cur.execute(sq.limit_lock, (what.name,))
            held, elapsed = await cur.fetchone()
            if what.concurrency is not None:
                await cur.execute(sq.running_count, (what.name,))
                (running,) = await cur.fetchone()
                limit = min(limit, what.concurrency - int(running))
            if what.rate is not None:
                tokens = min(float(what.burst), float(held) + float(elapsed) * what.rate)
                limit = min(limit, math.floor(tokens))
        if limit < 1:
            return TaskClaimed(None)
        names = self.names
        if names is not None and what.skip:
            names = [n for n in names if n not in what.skip]
        skip = list(what.skip) if names is None else []
        key_rated = what.key_rate is not None and what.name is not None
        statement = sq.claim_lock(
            None if names is None else len(names), len(skip), what.name is not None,
            what.alone, key_rated,
        )  # fmt: skip
        params: list[Any] = [what.queue, *(names or ())]
        if what.name is not None:
            params.append(what.name)
        params.extend(skip)
        if key_rated:
            params.extend((float(what.key_burst), what.key_rate, what.name, float(what.key_burst)))
        await cur.execute(statement, (*params, limit))
        locked = list(await cur.fetchall())
        blocked = await self._behind_their_keys(cur, locked, what)
        over, key_tokens = await self._over_their_keys_rate(cur, what, locked, blocked)
        suspects = False
        live: list[int] = []
        dead: list[int] = []
        for task_id, status, attempts, spared, lapses, cap, _key in locked:
            if task_id in blocked:
                continue
            ambiguous = status == TaskStatus.RUNNING and lapses < SUSPECT_LAPSES
            if (lapses + ambiguous >= SUSPECT_LAPSES) != what.alone:
                suspects = True
                continue
            if task_id in over:  # its key's bucket is spent: it waits, no attempt spent
                continue
            if not ambiguous and attempts - spared >= (cap if cap is not None else max_attempts):
                dead.append(task_id)
            else:
                live.append(task_id)
        if live:
            await cur.execute(
                with_ids(sq.claim_lease, len(live)), (micros(lease), str(token), owner, *live)
            )
        if dead:
            await cur.execute(with_ids(sq.claim_dead, len(dead)), (owner, *dead))
        if what.rate is not None and what.name is not None:
            await cur.execute(sq.limit_spend, (tokens - len(live), what.name))
        if key_tokens:
            await self._spend_key_tokens(cur, what, locked, live, key_tokens)
        if not live and not dead:
            return TaskClaimed(None, suspects)
        ids = live + dead
        await cur.execute(with_ids(sq.claim_read, len(ids)), ids)
        rows = {r[0]: r for r in await cur.fetchall()}
        claimed = sorted((_claimed(rows[i]) for i in live), key=lambda t: (-t.priority, t.id))
        dead_letters = [(_claimed(rows[i]), "crash_loop", str(rows[i][-1])) for i in dead]
        return TaskClaimed(Claim(token, [t.id for t in claimed], claimed, dead_letters), suspects)

    async def _behind_their_keys(
        self, cur: Any, locked: list[tuple[Any, ...]], what: TaskClaim
    ) -> set[int]:
        """The locked keyed tasks with an earlier live task of their key (read after the
        lock, so a task another claim holds counts): not claimable yet. A fair name's are
        claimable whatever runs of their key; a name with N > 1 runs a key's first N."""
        keys = sorted({r[6] for r in locked if r[6] is not None})
        if not keys or what.fair is not None:
            return set()
        if what.per_key > 1:
            statement = self.sql.key_turns.replace("{keys}", ids_in(len(keys)))
            await cur.execute(statement, (*keys, what.per_key))
            turn = {int(r[0]) for r in await cur.fetchall()}
            return {r[0] for r in locked if r[6] is not None and r[0] not in turn}
        await cur.execute(self.sql.key_heads.replace("{keys}", ids_in(len(keys))), keys)
        head = {k: int(i) for k, i in await cur.fetchall()}
        return {r[0] for r in locked if r[6] is not None and head.get(r[6], r[0]) < r[0]}

    async def _over_their_keys_rate(
        self, cur: Any, what: TaskClaim, locked: list[tuple[Any, ...]], blocked: set[int]
    ) -> tuple[set[int], dict[str, float]]:
        """rate_per_key: each key's bucket (refilled) and the locked tasks beyond its tokens,
        oldest first, of those this claim would take (PostgreSQL's _KEY_RATE_BATCH)."""
        if what.key_rate is None or what.name is None:
            return set(), {}
        rows = [r for r in locked if r[6] is not None and r[0] not in blocked]
        keys = sorted({r[6] for r in rows})
        if not keys:
            return set(), {}
        statement = self.sql.key_buckets.replace("{digests}", digests_in(len(keys)))
        await cur.execute(statement, (float(what.key_burst), what.key_rate, what.name, *keys))
        tokens = {k: float(what.key_burst) for k in keys}
        tokens.update({str(k): float(v) for k, v in await cur.fetchall()})
        over: set[int] = set()
        turns: Counter[str] = Counter()
        for task_id, status, _a, _s, lapses, _cap, key in sorted(rows):
            ambiguous = status == TaskStatus.RUNNING and lapses < SUSPECT_LAPSES
            if (lapses + ambiguous >= SUSPECT_LAPSES) == what.alone:
                turns[key] += 1
                if turns[key] > math.floor(tokens[key]):
                    over.add(task_id)
        return over, tokens

    async def _spend_key_tokens(
        self,
        cur: Any,
        what: TaskClaim,
        locked: list[tuple[Any, ...]],
        live: list[int],
        tokens: dict[str, float],
    ) -> None:
        """Each key's bucket less the tasks this claim started of it (under the name's row
        lock: two claims never spend one token)."""
        key_of = {r[0]: r[6] for r in locked}
        started = Counter(key_of[i] for i in live if key_of[i] in tokens)
        for key, count in sorted(started.items()):
            values = (what.name, key, key, tokens[key] - count, what.key_rate, what.key_burst)
            await cur.execute(self.sql.key_spend, values)

    # -- settle ---------------------------------------------------------------------------

    async def settle(self, claim: Claim[ClaimedTask], decisions: Sequence[Decision]) -> Settled:
        if (
            self.on_settle is None
            and decisions.count(DONE) == len(decisions)
            and not any(
                t.completed or t.keep is not None or t.has_dependents or t.key is not None
                for t in claim.items
            )
        ):
            changed = await self._grouped.add((claim.ids, str(claim.token)))
            kept = [i for i in claim.ids if i in changed]
            return Settled(kept, len(claim.ids) - len(kept))
        return await self._settle(claim, decisions)

    async def _settle_done(self, group: list[tuple[list[int], str]]) -> set[int]:
        """Plain completions of several claims in one transaction, each fenced by its own
        claim's token: the rows locked and their tokens compared, the matching ones done."""
        wanted = {(i, token) for ids, token in group for i in ids}
        ids = sorted({i for i, _token in wanted})
        keep = self.retention == "keep"
        stmt = self.sql.locked_done_keep if keep else self.sql.locked_done_delete

        async def run(cur: Any) -> set[int]:
            await cur.execute("BEGIN")
            await cur.execute(with_ids(self.sql.fenced_tokens, len(ids)), ids)
            held = sorted(r[0] for r in await cur.fetchall() if (r[0], r[1]) in wanted)
            if held:
                await cur.execute(with_ids(stmt, len(held)), held)
            await cur.execute("COMMIT")
            return set(held)

        return await self._run("settle", run)  # type: ignore[no-any-return]

    async def _settle(self, claim: Claim[ClaimedTask], decisions: Sequence[Decision]) -> Settled:
        sq = self.sql
        token = str(claim.token)
        left = [k for k, t in enumerate(claim.items) if not t.completed]
        rest = Claim(claim.token, [claim.ids[k] for k in left], [claim.items[k] for k in left])
        groups = group_decisions(rest, [decisions[k] for k in left], unknown=None)
        task_of = dict(zip(rest.ids, rest.items, strict=True))

        async def run(cur: Any) -> list[int]:
            await cur.execute("BEGIN")
            # Completed in their own transaction: settled; a kept value follows now.
            for task in claim.items:
                if task.completed and task.keep is not None:
                    await cur.execute(sq.set_result, (task.result, task.id, task.attempt))
            held: set[int] = set()
            if rest.ids:
                await cur.execute(with_ids(sq.fenced_ids, len(rest.ids)), (*rest.ids, token))
                held = {r[0] for r in await cur.fetchall()}
            plain = [i for i in groups.done if i in held and task_of[i].keep is None]
            if plain:
                stmt = sq.settle_done_keep if self.retention == "keep" else sq.settle_done_delete
                await cur.execute(with_ids(stmt, len(plain)), (*plain, token))
            for i in groups.done:
                task = task_of[i]
                if i in held and task.keep is not None:
                    kept = (task.result, micros(task.keep), task.progress, i, token)
                    await cur.execute(sq.settle_done_result, kept)
            for i, is_dead, delay, error, refund in groups.failures():
                if i not in held:
                    continue
                task = task_of[i]
                status = TaskStatus.FAILED if is_dead else TaskStatus.PENDING
                values = (int(refund), int(refund), int(status), micros(delay), error,
                          task.error_type, task.traceback, int(status), i, token)  # fmt: skip
                await cur.execute(sq.settle_failure, values)
            await self._events(cur, claim, decisions, held)
            await cur.execute("COMMIT")
            return [i for i in claim.ids if i in held or task_of.get(i) is None]

        settled = await self._run("settle", run)
        done = set(settled)
        # What waits for these tasks, each in a transaction of its own (after the settle's
        # COMMIT: of two upstream tasks finishing at once, the later release sees both).
        upstream = [t.id for t in claim.items if t.has_dependents and t.id in done]
        keys = sorted({
            t.key for t, d in zip(claim.items, decisions, strict=True)
            if t.key is not None and t.id in done and d.verdict in (Verdict.DONE, Verdict.DEAD)
        })  # fmt: skip
        try:
            if upstream:
                await self.release_dependents(upstream, RELEASE_BATCH)
            if keys:
                await self._promote(keys)
        except StoreError as exc:  # settled all the same: the sweep releases them
            log.debug("releasing what waits for %s failed: %s", claim.ids, exc)
        return Settled(settled, len(claim.ids) - len(settled))

    async def _events(
        self, cur: Any, claim: Claim[ClaimedTask], decisions: Sequence[Decision], held: set[int]
    ) -> None:
        """The lifecycle events of the tasks this settle changed (``held``: its fence let
        them through), inserted before its COMMIT: both or neither, and none for a zombie."""
        if self.on_settle is None:
            return
        pairs = [(task, decision) for task, decision in zip(claim.items, decisions, strict=True)
                 if task.id in held]  # fmt: skip
        await _insert_events(cur, self.on_settle(pairs) if pairs else None)

    async def _dead_letter_events(self, cur: Any, found: TaskClaimed) -> None:
        """The events of the tasks the crash-loop guard dead-lettered in this claim, in its
        transaction (as PostgreSQL's claim writes them)."""
        if self.on_settle is None or found.claim is None or not found.claim.dead:
            return
        for task, _reason, _error in found.claim.dead:
            task.error_type = "CrashLoop"
        dead = [(t, Decision(Verdict.DEAD, error=e)) for t, _r, e in found.claim.dead]
        await _insert_events(cur, self.on_settle(dead))

    async def _promote(self, keys: Sequence[str]) -> int:
        """The next waiting tasks of each key, up to its room: a key's live tasks plus a
        waiting one's turn at most its name's ``concurrency_per_key`` (1: the next one once
        the key has no live task); a fair name's, its key's pending ones plus its turn at
        most ``fair_share`` (PostgreSQL's PROMOTE_KEYS, a transaction a key)."""
        sq = self.sql
        most = max([*self.per_key.values(), self.fair_share if self.fair else 1])

        async def run(cur: Any) -> int:
            moved = 0
            for key in keys:
                await cur.execute("BEGIN")
                await cur.execute(sq.key_waiting_lock, (key, most))
                waiting = [(int(i), str(n)) for i, n in await cur.fetchall()]
                if waiting:
                    await cur.execute(sq.key_room, (key, most, key, self.fair_share))
                    live, pending = (int(n) for n in await cur.fetchone())
                    plain, behind = self._turns(waiting, live, pending)
                    for statement, ids in ((sq.promote_ids, plain), (sq.promote_behind, behind)):
                        if ids:
                            await cur.execute(with_ids(statement, len(ids)), ids)
                            moved += cur.rowcount
                await cur.execute("COMMIT")
            return moved

        moved: int = await self._run("settle", run)
        if moved:
            self._gate_wake()
        return moved

    def _turns(
        self, waiting: list[tuple[int, str]], live: int, pending: int
    ) -> tuple[list[int], list[int]]:
        """Of a key's first waiting tasks (id order), those with room: made pending where
        they are, and (a fair name's but its key's only pending one) behind those due."""
        plain: list[int] = []
        behind: list[int] = []
        for turn, (task_id, name) in enumerate(waiting, 1):
            if name in self.fair:
                if pending + turn <= self.fair_share:
                    (behind if pending or turn > 1 else plain).append(task_id)
            elif live + turn <= self.per_key.get(name, 1):
                plain.append(task_id)
        return plain, behind

    async def progress(self, updates: Sequence[tuple[int, uuid.UUID, str]]) -> int:
        async def run(cur: Any) -> int:
            written = 0
            for task_id, token, value in updates:
                await cur.execute(self.sql.set_progress, (value, task_id, str(token)))
                written += cur.rowcount
            return written

        return await self._run("settle", run)  # type: ignore[no-any-return]

    async def purge_kept(self, limit: int) -> int:
        async def run(cur: Any) -> int:
            await cur.execute(self.sql.purge_kept, (limit,))
            purged = int(cur.rowcount)
            await cur.execute(self.sql.gone_edges, (limit,))
            gone = [r[0] for r in await cur.fetchall()]
            if gone:
                await cur.execute(with_ids(self.sql.prune_edges, len(gone)), gone)
            await cur.execute(self.sql.prune_key_rates, (limit,))
            return max(purged, int(cur.rowcount))

        return await self._run("settle", run)  # type: ignore[no-any-return]

    async def release_dependents(self, ids: Sequence[int] | None, limit: int) -> int:
        sq = self.sql

        async def run(cur: Any) -> int:
            await cur.execute("BEGIN")
            if ids is None:
                await cur.execute(sq.any_dependents, (limit,))
            else:
                await cur.execute(with_ids(sq.dependents_of, len(ids)), (*ids, limit))
            waiting = [r[0] for r in await cur.fetchall()]
            moved = 0
            if waiting:
                await cur.execute(with_ids(sq.dependents_state, len(waiting)), waiting)
                ready: list[int] = []
                for task_id, after_failure, live, bad in await cur.fetchall():
                    if bad is not None and after_failure == 0:
                        await cur.execute(sq.release_cancelled, (bad, task_id))
                        moved += cur.rowcount
                    elif not live:
                        ready.append(task_id)
                if ready:
                    await cur.execute(with_ids(sq.release_pending, len(ready)), ready)
                    moved += cur.rowcount
            await cur.execute("COMMIT")
            return moved

        moved: int = await self._run("settle", run)
        if ids is None:  # the sweep: keys whose next task nobody promoted too
            moved += await self._sweep_keys(limit)
        if moved:
            self._gate_wake()
        return moved

    async def _sweep_keys(self, limit: int) -> int:
        async def run(cur: Any) -> list[str]:
            await cur.execute(self.sql.waiting_keys, (limit,))
            return [r[0] for r in await cur.fetchall()]

        keys: list[str] = await self._run("settle", run)
        return await self._promote(keys) if keys else 0

    def dependencies(self, conn: Any, task_id: int) -> list[dict[str, Any]]:
        with conn.cursor() as cur:
            cur.execute(self.sql.read_dependencies, (task_id,))
            names = [d[0] for d in cur.description]
            return [result_row(names, r) for r in cur.fetchall()]

    async def adependencies(self, conn: Any, task_id: int) -> list[dict[str, Any]]:
        async with conn.cursor() as cur:
            await cur.execute(self.sql.read_dependencies, (task_id,))
            names = [d[0] for d in cur.description]
            return [result_row(names, r) for r in await cur.fetchall()]

    # -- heartbeat, release, hasten, unhandled names ------------------------------------------

    async def _count(self, statement: str, params: Sequence[Any]) -> int:
        async def run(cur: Any) -> int:
            await cur.execute(statement, params)
            return int(cur.rowcount)

        return await self._run("settle", run)  # type: ignore[no-any-return]

    async def extend_leases(self, claim: Claim[ClaimedTask], lease: float) -> int:
        statement = with_ids(self.sql.extend, len(claim.ids))
        return await self._count(statement, (micros(lease), *claim.ids, str(claim.token)))

    async def release(self, claim: Claim[ClaimedTask]) -> int:
        ids = [i for i, t in zip(claim.ids, claim.items, strict=True) if not t.completed]
        if not ids:
            return 0
        return await self._count(with_ids(self.sql.release, len(ids)), (*ids, str(claim.token)))

    async def hasten(self, ids: Sequence[int]) -> int:
        return await self._count(with_ids(self.sql.hasten, len(ids)), ids) if ids else 0

    async def fail_unhandled(self, grace: float, limit: int) -> list[str]:
        names = self.names or []
        lock = self.sql.fail_unhandled_lock.replace("{queues}", ids_in(len(self.queues)))
        lock = lock.replace("{names}", f"AND task_name NOT {ids_in(len(names))}" if names else "")

        async def run(cur: Any) -> list[str]:
            await cur.execute("BEGIN")
            await cur.execute(lock, (*self.queues, micros(grace), *names, limit))
            rows = list(await cur.fetchall())
            if rows:
                ids = [r[0] for r in rows]
                values = (f"{grace:g}", *ids)
                await cur.execute(with_ids(self.sql.fail_unhandled, len(ids)), values)
            await cur.execute("COMMIT")
            return [str(r[1]) for r in rows]

        return await self._run("settle", run)  # type: ignore[no-any-return]

    # -- a handler's own transaction, completed fenced -----------------------------------------

    @contextlib.contextmanager
    def transaction(self, label: str) -> Iterator[Any]:
        conn = connect(self.dsn, autocommit=False)
        try:
            yield conn
        finally:
            conn.close()  # (the server rolls back whatever was not committed)

    @contextlib.asynccontextmanager
    async def atransaction(self, label: str) -> AsyncIterator[Any]:
        import aiomysql

        args = dict(self._args)
        args["db"] = args.pop("database")
        conn = await aiomysql.connect(
            **args, autocommit=False, connect_timeout=10, cursorclass=quiet_cursor()
        )
        try:
            yield conn
        finally:
            conn.close()

    def _completion(
        self, task_id: int, token: uuid.UUID, keep: float | None, progress: str | None
    ) -> tuple[str, tuple[Any, ...]]:
        if keep is None:
            return self._complete, (task_id, str(token))
        return self.sql.complete_kept, (micros(keep), progress, task_id, str(token))

    def complete(
        self,
        conn: Any,
        task_id: int,
        token: uuid.UUID,
        keep: float | None = None,
        progress: str | None = None,
    ) -> bool:
        with conn.cursor() as cur:
            cur.execute(*self._completion(task_id, token, keep, progress))
            return bool(cur.rowcount)

    async def acomplete(
        self,
        conn: Any,
        task_id: int,
        token: uuid.UUID,
        keep: float | None = None,
        progress: str | None = None,
    ) -> bool:
        async with conn.cursor() as cur:
            await cur.execute(*self._completion(task_id, token, keep, progress))
            return bool(cur.rowcount)

    # -- wake-ups: enqueues of this process only (wakeup.py) -------------------------------

    def _gate_wake(self) -> None:
        """Tasks became pending (promoted, released): this process's waiting worker claims."""
        wakeup.committed(self.table)
