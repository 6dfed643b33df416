"""PostgreSQL's queue store for task mode (outboxkit.queue.store.QueueStore over a task table).

The worker's claim loop (outboxkit.queue.loop) runs against it exactly as the relay runs
against the outbox's (backends/postgres/queue_pg.py): claims and settles on two autocommit
connections, every settle, extension and release fenced by the claim token. The statements are
backends/postgres/tasks_sql.py's; connections, wake-ups and errors
backends/postgres/_pg_session.py's (shared)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads

from outboxkit._text import first_line
from outboxkit.backends.postgres._connection import (
    PoolerMode,
    aconnect,
    admin_connection,
    connect,
)
from outboxkit.backends.postgres._pg_session import PgSession, fetch_rows
from outboxkit.backends.postgres.postgres import parse_table
from outboxkit.backends.postgres.tasks_sql import (
    TaskStatements,
    done_arrays,
    fair_table_name,
    key_rates_table_name,
    limits_table_name,
    queues_table_name,
)
from outboxkit.errors import SchemaError
from outboxkit.queue.settle import group_decisions
from outboxkit.queue.store import (
    DONE,
    Claim,
    Decision,
    Settled,
    StoreError,
    StoreInfo,
    StoreUnavailable,
    Verdict,
)
from outboxkit.queue.tasks import (
    DEFAULT_MAX_TASK_NAMES,
    FAIR_SHARE,
    OTHER_TASKS,
    PARK_BATCH,
    ClaimedTask,
    LimitsSeen,
    Retention,
    SettleHook,
    TaskClaim,
    TaskClaimed,
    TaskStatus,
    UndecodablePayload,
    task_finished,
    task_gone,
    task_late,
)

log = logging.getLogger("outboxkit.worker")
_R = TypeVar("_R")

#: The start-up count of pending tasks stops here.
PENDING_CAP = 100_000
#: Waiting tasks one release statement decides at most (a settle's, or the sweep's).
RELEASE_BATCH = 1000


def _load_payload(data: bytes | str) -> Any:
    """The claim's JSON loader: per row, so one bad row does not fail the whole claim (it
    raised out of the claim and the worker exited, its neighbours dead-lettered unrun)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        return UndecodablePayload(str(exc))


def _claimed(row: Sequence[Any]) -> ClaimedTask:
    """A CLAIM row (its error column last) as a ClaimedTask."""
    (task_id, name, queue, payload, attempt, max_attempts, key, priority, created_at,
     spared) = row[:10]  # fmt: skip
    return ClaimedTask(
        task_id, name, queue, payload, attempt, max_attempts, key, priority, created_at,
        spared, has_dependents=bool(row[10]), trace=row[11],
    )  # fmt: skip


def _raw_json(data: bytes | str) -> str:
    return data.decode() if isinstance(data, bytes) else data


class PgTaskStore(PgSession):
    """A task table as task mode's store (the port of queue/tasks.py).

    ``queues``: the queues this worker serves; ``names``: the task names it has handlers
    for (it claims only those; None: any). ``retention="delete"`` (default) deletes a
    finished task; ``"keep"`` marks it done. ``per_key``: task name -> its
    ``concurrency_per_key`` above 1 (how many of a key's tasks its promotions make pending;
    every other name's keys run one at a time). ``fair``: the task names with
    ``fair=True``: at most ``fair_share`` of a key pending at once, each promoted behind the
    tasks already due; how many run is not limited.
    """

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        queues: Sequence[str] = ("default",),
        retention: Retention = "delete",
        name: str = "outboxkit-worker",
        on_settle: SettleHook | None = None,
        pooler: PoolerMode | None = None,
        direct_dsn: str | None = None,
        names: Sequence[str] | None = None,
        per_key: Mapping[str, int] | None = None,
        fair: Sequence[str] = (),
        fair_share: int = FAIR_SHARE,
    ) -> None:
        self.sql = TaskStatements(table)
        self.per_key = {n: k for n, k in (per_key or {}).items() if k > 1}
        self.fair, self.fair_share = sorted(fair), fair_share
        # A fair name's keys whose next tasks this worker's last claim of them made pending:
        # its claims keep them fed, so their settles skip the promotion (a statement per
        # settle: it halved a flooding key's drain). A hint, never a count: the sweep
        # promotes whatever it misses, and other keys' settles promote as before.
        self._fed: set[str] = set()
        #: The task names this worker has handlers for: it claims only those (None: any).
        self.names = None if names is None else sorted(names)
        #: Behind a transaction pooler (``pooler``, or found by the connection factory)
        #: claims and settles work as they are (no prepared statements where the pooler
        #: loses them); LISTEN and the wake-up gate's session lock run on ``direct_dsn``
        #: (PostgreSQL itself) or not at all, and the poll finds every task (as PgQueueStore).
        super().__init__(
            dsn,
            name=name,
            pooler=pooler,
            direct_dsn=direct_dsn,
            channel=self.sql.channel,
            try_wake_lock=self.sql.try_wake_lock,
            wake_unlock=self.sql.wake_unlock,
            log=log,
            who="worker",
            what="tasks",
            due_in=self.sql.due_in,
        )
        self._complete = self.sql.complete_keep if retention == "keep" else self.sql.complete_delete
        #: Task lifecycle events: written in the settle's own transaction (see SettleHook).
        self.on_settle = on_settle
        self.table = table
        self.queues = list(queues)
        self._due_params = {"queues": self.queues, "names": self.names}
        self.retention: Retention = retention
        self._settle_lock = asyncio.Lock()
        # Completions waiting to be settled together (_settle_done_grouped).
        self._done_queue: list[tuple[list[int], uuid.UUID, asyncio.Future[set[int]]]] = []
        self._flushing = False
        #: The names its claims limit and those they do not (the sweep's parking).
        self.limits_seen = LimitsSeen()
        #: Its fair names are in the table's {fair} rows (TELL_FAIR, at its first claim).
        self._told_fair = not self.fair and not self.names

    # Its claim and settles are planned once per connection (the claim's plan does not
    # depend on its parameters: the claim index in order, stopped at the limit).
    generic_plans = True

    def __repr__(self) -> str:
        return f"PgTaskStore(table={self.table!r}, queues={self.queues!r})"

    def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        set_json_loads(_load_payload, conn)

    async def _prepare_listen(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """A parked worker's claims and sweeps run on its LISTEN session: the same loaders,
        planned once as on its claim and settle connections (PgSession.generic_plans), its
        queue's claim prepared there now (a claim that takes nothing): the first claim after
        an idle spell is not planned then (a first claim on a connection took 11-12 ms,
        the next ones 2-5, on this loaded machine)."""
        self._configure(conn)
        if self.generic_plans and self.session_state:
            await conn.execute("SET plan_cache_mode = force_generic_plan")
            what = TaskClaim(self.queues[0]) if self.queues else None
            if what is not None and self.on_settle is None:
                params = self._claim_params(what, 0, 1.0, uuid.uuid4(), "", 1)
                await conn.execute(self._claim_statement(params), params, prepare=True)
        return True

    def _missing(self, exc: Exception | None = None) -> SchemaError:
        _schema, name = parse_table(self.table)
        newer = (queues_table_name(name), limits_table_name(name), key_rates_table_name(name),
                 fair_table_name(name))  # fmt: skip
        if isinstance(exc, pg_errors.UndefinedColumn) or any(t in str(exc) for t in newer):
            return SchemaError(
                f"task table {self.table!r} is older than this outboxkit (the server says:"
                f" {str(exc).splitlines()[0]}): upgrade it with `outboxkit migrate --tasks"
                f" --dsn ... --tasks-table {self.table}`, then start the worker again"
            )
        return SchemaError(
            f"task table {self.table!r} not found: run `outboxkit migrate --tasks --dsn ..."
            f" --tasks-table {self.table}`"
        )

    async def start(self) -> StoreInfo:
        try:
            conn = await self._connection("claim")
            cur = await conn.execute(self.sql.count_pending, (PENDING_CAP,))
            row = await cur.fetchone()
            vacuum = await (await conn.execute(self.sql.autovacuum_off)).fetchone()
            await conn.execute(self.sql.check_columns)
            cur = await conn.execute(self.sql.paused_queues, (self.queues,))
            paused = [str(r[0]) for r in await cur.fetchall()]
        except (pg_errors.UndefinedTable, pg_errors.UndefinedColumn) as exc:
            raise self._missing(exc) from None
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        if paused:
            log.warning(
                "queue(s) %s paused: this worker claims from them once resumed"
                " (`outboxkit tasks resume QUEUE`)",
                ", ".join(paused),
            )
        pending = int(row[0]) if row else 0
        where = f"database {conn.info.dbname} on {conn.info.host}"
        if vacuum and vacuum[0]:
            log.warning(
                "task table %r is never vacuumed (%s): every task leaves dead row versions"
                " that nothing reclaims, so the table and the claim's time grow without bound."
                " Turn autovacuum on, or run `VACUUM %s` every minute (docs/tasks.md,"
                ' "Table health")',
                self.table,
                vacuum[0],
                self.sql.qualified,
            )
        return StoreInfo(pending, pending >= PENDING_CAP, where)

    # -- claim and settle ---------------------------------------------------------------

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
        params = self._claim_params(what, limit, lease, token, owner, max_attempts)
        self.lease = lease  # (the bound of this claim's and its settles' round trips)
        self.limits_seen.learn(what, self.names)
        try:
            conn = await self._claim_connection()
            if conn is None:
                return TaskClaimed(None)  # (parked: nothing due in its queues)
            if conn is self._listen_conn:  # (unparking: the claim connection opens meanwhile)
                records = await self._on_listen("claim", lambda c: self._claiming(c, params))
            else:
                records = await self.within(conn, "claim", self._claiming(conn, params))
        except (pg_errors.UndefinedTable, pg_errors.UndefinedColumn) as exc:
            raise self._missing(exc) from None
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        return await self._claimed(what, records, token)

    def _claim_params(
        self,
        what: TaskClaim,
        limit: int,
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
    ) -> dict[str, Any]:
        return {
            "queue": what.queue,
            "alone": what.alone,
            "limit": limit,
            "lease": lease,
            "token": token,
            "owner": owner,
            "max_attempts": max_attempts,  # for tasks enqueued without their own
            # The queue's ordinary claim takes the names this worker has handlers for but
            # the limited ones (their own claims take those): a plain list, well planned.
            "names": self.names
            if not what.skip or self.names is None
            else [n for n in self.names if n not in what.skip],
            "name": what.name,
            "concurrency": what.concurrency,
            "rate": what.rate,
            "burst": what.burst,
            "skip": list(what.skip),
            "per_key": what.per_key,
            "key_rate": what.key_rate,
            "key_burst": what.key_burst,
            "fair": what.fair is not None,
        }

    async def _claimed(self, what: TaskClaim, records: list[Any], token: uuid.UUID) -> TaskClaimed:
        """A claim's rows as its result (the next tasks of a per-key or fair claim's keys
        promoted)."""
        suspects = any(r[0] is None for r in records)
        rows = [r for r in records if r[0] is not None]
        if not rows:
            return TaskClaimed(None, suspects)
        self.claimed_some()
        keys = sorted({r[6] for r in rows if r[6] is not None and r[-1] is None})
        more = False
        if (what.per_key > 1 or what.fair is not None) and keys:  # room for the next ones now
            try:
                promoted = await self._promote(keys)
                if what.fair is not None:
                    more, self._fed = bool(promoted), promoted
            except StoreError as exc:  # claimed all the same: the sweep promotes them
                log.debug("promoting the next tasks of keys %s failed: %s", keys, exc)
        dead = [(_claimed(r), "crash_loop", r[-1]) for r in rows if r[-1]]
        # Highest priority first, then by id: the order a worker starts them in (a claim
        # may take more than its free slots: the rest wait their turn in this order).
        live = sorted((r for r in rows if r[-1] is None), key=lambda r: (-int(r[7]), int(r[0])))
        claim = Claim(token, [r[0] for r in live], [_claimed(r) for r in live], dead)
        return TaskClaimed(claim, suspects, more)

    async def _claiming(
        self, conn: psycopg.AsyncConnection[Any], params: dict[str, Any]
    ) -> list[Any]:
        """The claim's round trips on ``conn`` (the claim connection, or the LISTEN session
        of a parked store that unparks)."""
        if not self._told_fair:
            await conn.execute(self.sql.tell_fair, self._fairness())
            self._told_fair = True
        if self.on_settle is None and params["name"] is None:
            return await fetch_rows(conn.cursor(), self._claim_statement(params), params)
        return await self._claim_with_events(conn, params)

    def _claim_statement(self, params: dict[str, Any]) -> str:
        """The claim for these parameters: a limited name's, one skipping the limited names
        (a store claiming any name), or the plain one."""
        if params["name"] is not None:
            return self.sql.claim_limited
        if params["skip"] and params["names"] is None:
            return self.sql.claim_skipping
        return self.sql.claim

    async def _claim_with_events(
        self, conn: psycopg.AsyncConnection[Any], params: dict[str, Any]
    ) -> list[Any]:
        """The claim and the lifecycle events of what its crash-loop guard dead-lettered, in
        one transaction (the dead letters and their events commit together or not at all).
        A limited name's claim takes its name's lock first, by a statement of its own: the
        claim's snapshot then sees every claim of the name committed before (CLAIM)."""
        async with conn.transaction():
            if params["name"] is not None:
                # Planned with its values: a generic plan of the limited claim (its LIMIT an
                # expression) gave up the index walk, 26.8 ms a claim against 1.7 ms.
                await conn.execute(self.sql.custom_plans)
            if any(params[k] is not None for k in ("concurrency", "rate", "key_rate")):
                await conn.execute(self.sql.claim_limit_lock, (params["name"],))
            if params["rate"] is not None:
                await conn.execute(self.sql.claim_bucket, (params["name"], params["burst"]))
            claim = self._claim_statement(params)
            records = await fetch_rows(conn.cursor(), claim, params)
            taken = sum(1 for r in records if r[0] is not None)
            if params["concurrency"] is not None and taken:  # the next parked ones, under
                promote = {"name": params["name"], "queue": params["queue"], "count": taken}
                await conn.execute(self.sql.promote_name, promote)  # the name's lock
            dead = [(_claimed(r), r[-1]) for r in records if r[0] is not None and r[-1]]
            if dead and self.on_settle is not None:
                for task, _error in dead:
                    task.error_type = "CrashLoop"
                extra = self.on_settle([(t, Decision(Verdict.DEAD, error=e)) for t, e in dead])
                if extra is not None:
                    await conn.execute(extra[0], extra[1])
        return records

    async def settle(self, claim: Claim[ClaimedTask], decisions: Sequence[Decision]) -> Settled:
        if (
            self.on_settle is None
            and decisions.count(DONE) == len(decisions)
            and not any(t.completed or t.keep is not None or t.has_dependents for t in claim.items)
        ):
            settled = await self._settle_done_grouped(claim)
        else:
            settled = await self._settle(claim, decisions)
        # What waits for these tasks, each in a statement of its own (after the settle's
        # commit: of two upstream tasks finishing at once on two workers, the later release
        # sees both): their dependents, and the next task of each key they held.
        done = set(settled.ids)
        upstream = [t.id for t in claim.items if t.has_dependents and t.id in done]
        keys = sorted({
            t.key for t, d in zip(claim.items, decisions, strict=True)
            if t.key is not None and t.id in done and d.verdict in (Verdict.DONE, Verdict.DEAD)
            and not (t.key in self._fed and t.task_name in self.fair)
        })  # fmt: skip
        try:
            if upstream:
                await self.release_dependents(upstream, RELEASE_BATCH)
            if keys:
                await self._promote(keys)
        except StoreError as exc:  # settled all the same: the sweep releases them
            log.debug("releasing what waits for %s failed: %s", claim.ids, exc)
        return settled

    async def _park(self, conn: psycopg.AsyncConnection[Any], limit: int) -> int:
        """The sweep's side of the tasks parked behind a full limit: each limited name's
        first N due parked tasks promoted, then its pending unkeyed tasks beyond the first N
        parked (PARK_BATCH times ``limit`` a statement, besides the N it may have just
        promoted: each sorts the name's pending tasks); parked tasks of a name claimed
        without a limit promoted. How many it moved for good (a full batch: ``limit``, so
        the sweep runs again at once)."""
        moved = 0
        for (name, queue), keep in sorted(self.limits_seen.limits.items()):
            batch = PARK_BATCH * limit + keep
            params = {"name": name, "queue": queue, "keep": keep, "count": keep,
                      "limit": batch}  # fmt: skip
            async with conn.transaction():  # (one of the name's claims at a time)
                await conn.execute(self.sql.claim_limit_lock, (name,))
                await conn.execute(self.sql.promote_name, params)
                cur = await conn.execute(self.sql.park_name, params)
            moved += limit if cur.rowcount >= batch else 0
        if self.limits_seen.unlimited:
            names = {"names": sorted(self.limits_seen.unlimited), "limit": limit}
            moved += (await conn.execute(self.sql.unpark_names, names)).rowcount
        return moved

    def _fairness(self) -> dict[str, Any]:
        """TELL_FAIR's parameters: this worker's fair names, its share, the names it handles
        without fair=."""
        plain = sorted(set(self.names or ()) - set(self.fair))
        return {"fair": self.fair, "share": self.fair_share, "plain": plain}

    def _turns(self) -> dict[str, Any]:
        """The promotions' parameters: each name's tasks of one key at once (PROMOTE_KEYS)."""
        names = sorted(self.per_key)
        return {
            "per_key_names": names,
            "per_key": [self.per_key[n] for n in names],
            "fair_names": self.fair,
            "fair_share": self.fair_share,
            "most": max([*self.per_key.values(), self.fair_share if self.fair else 1]),
            "channel": self.sql.channel,
        }

    async def _promote(self, keys: Sequence[str]) -> set[str]:
        """The next waiting tasks of each of ``keys``, up to their key's room; the keys that
        had some."""
        params = {"keys": list(keys), **self._turns()}
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:
                rows = await self.within(
                    conn, "promote", fetch_rows(conn.cursor(), self.sql.promote_keys, params)
                )
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        return {str(r[1]) for r in rows}

    async def _settle(self, claim: Claim[ClaimedTask], decisions: Sequence[Decision]) -> Settled:
        # Tasks completed in their own transaction (ctx.transaction()) are settled already;
        # those that keep their result get it now (it exists once the handler returned).
        settled = [i for i, t in zip(claim.ids, claim.items, strict=True) if t.completed]
        for task in claim.items:
            if task.completed and task.keep is not None:
                value = (task.result, task.id, task.attempt, self.sql.results_channel)
                await self._run(self.sql.set_result, value)
        left = [k for k, t in enumerate(claim.items) if not t.completed]
        rest = Claim(claim.token, [claim.ids[k] for k in left], [claim.items[k] for k in left])
        groups = group_decisions(rest, [decisions[k] for k in left], unknown=None)
        task_of = dict(zip(rest.ids, rest.items, strict=True))
        statements: list[tuple[str, Sequence[Any]]] = []
        plain = [i for i in groups.done if task_of[i].keep is None]
        if plain:
            keep = self.retention == "keep"
            stmt = self.sql.settle_done_keep if keep else self.sql.settle_done_delete
            statements.append((stmt, (plain, claim.token)))
        kept = [task_of[i] for i in groups.done if task_of[i].keep is not None]
        if kept:
            results = ([t.id for t in kept], [claim.token] * len(kept),
                       [t.result for t in kept], [t.keep for t in kept],
                       [t.progress for t in kept])  # fmt: skip
            statements.append((self.sql.settle_done_results, (*results, self.sql.results_channel)))
        if groups.failed:
            failed = [task_of[i] for i in groups.failed]
            columns = (
                groups.failed,
                [int(TaskStatus.FAILED) if d else int(TaskStatus.PENDING) for d in groups.dead],
                groups.delays,
                groups.errors,
                [int(r) for r in groups.refund],
                [t.error_type for t in failed],
                [t.traceback for t in failed],
            )
            statements.append((self.sql.settle_failures, (*columns, claim.token)))
        if self.on_settle is None:
            for stmt, params in statements:
                settled.extend(await self._run(stmt, params))
        elif statements:
            settled.extend(await self._run_with_hook(claim, decisions, statements))
        # A dead letter is the result of a task that keeps one: wake whoever waits on it.
        done = set(settled)
        dead = [i for i, d in zip(groups.failed, groups.dead, strict=True)
                if d and i in done and task_of[i].keep is not None]  # fmt: skip
        if dead:
            await self._run(self.sql.notify_results, (self.sql.results_channel, dead))
        return Settled(settled, len(claim.ids) - len(settled))

    async def progress(self, updates: Sequence[tuple[int, uuid.UUID, str]]) -> int:
        ids, tokens, values = (list(column) for column in zip(*updates, strict=True))
        return await self._count(self.sql.set_progress, (ids, tokens, values), "progress")

    async def purge_kept(self, limit: int) -> int:
        async def purge(conn: psycopg.AsyncConnection[Any]) -> int:
            purged = (await conn.execute(self.sql.purge_kept, (limit,))).rowcount
            await conn.execute(self.sql.prune_edges, (limit,))
            return max(purged, (await conn.execute(self.sql.prune_key_rates, (limit,))).rowcount)

        return int(await self._sweeping("purge of kept results", purge))

    async def release_dependents(self, ids: Sequence[int] | None, limit: int) -> int:
        params = {"ids": None if ids is None else list(ids), "limit": limit,
                  "channel": self.sql.channel, "results": self.sql.results_channel}  # fmt: skip

        async def release(conn: psycopg.AsyncConnection[Any]) -> int:
            rows = await fetch_rows(conn.cursor(), self.sql.release_dependents, params)
            if ids is not None:
                return len(rows)
            # The sweep: keys whose next task nobody promoted too, and the limits' parking.
            sweep = {"limit": limit, **self._turns()}
            rows += await fetch_rows(conn.cursor(), self.sql.sweep_keys, sweep)
            return len(rows) + await self._park(conn, limit)

        return int(await self._sweeping("release", release, sweep=ids is None))

    def dependencies(self, conn: psycopg.Connection[Any], task_id: int) -> list[dict[str, Any]]:
        with conn.cursor(row_factory=dict_row) as cur:
            return list(cur.execute(self.sql.read_dependencies, (task_id,)).fetchall())

    async def adependencies(
        self, conn: psycopg.AsyncConnection[Any], task_id: int
    ) -> list[dict[str, Any]]:
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(self.sql.read_dependencies, (task_id,))
            return list(await cur.fetchall())

    async def _settle_done_grouped(self, claim: Claim[ClaimedTask]) -> Settled:
        """Complete ``claim``'s tasks, grouped with the completions waiting meanwhile: one
        statement for all of them (group commit), each fenced by its own token."""
        done: asyncio.Future[set[int]] = asyncio.get_running_loop().create_future()
        self._done_queue.append((claim.ids, claim.token, done))
        if not self._flushing:
            self._flushing = True
            batch: list[tuple[list[int], uuid.UUID, asyncio.Future[set[int]]]] = []
            try:
                while self._done_queue:
                    batch, self._done_queue = self._done_queue, []
                    arrays = done_arrays((claim_ids, t) for claim_ids, t, _f in batch)
                    keep = self.retention == "keep"
                    stmt = (
                        self.sql.settle_done_many_keep if keep else self.sql.settle_done_many_delete
                    )
                    try:
                        changed = set(await self._run(stmt, arrays))
                    except StoreError as exc:
                        for _ids, _t, waiter in batch:
                            if not waiter.done():
                                waiter.set_exception(exc)
                        continue
                    for _ids, _t, waiter in batch:
                        if not waiter.done():
                            waiter.set_result(changed)
            finally:
                self._flushing = False
                # Cancelled mid-statement (a forced shutdown): the others settle again.
                interrupted = StoreUnavailable("the grouped settle was interrupted")
                for _ids, _t, waiter in [*batch, *self._done_queue]:
                    if not waiter.done():
                        waiter.set_exception(interrupted)
                self._done_queue = []
        changed = await done
        kept = [i for i in claim.ids if i in changed]
        return Settled(kept, len(claim.ids) - len(kept))

    async def _run_with_hook(
        self,
        claim: Claim[ClaimedTask],
        decisions: Sequence[Decision],
        statements: list[tuple[str, Sequence[Any]]],
    ) -> list[int]:
        """The settle's statements and the hook's in one transaction: both or neither."""
        assert self.on_settle is not None
        try:
            conn = await self._connection("settle")
            on_settle = self.on_settle

            async def settle() -> list[int]:
                async with conn.transaction():
                    changed: list[int] = []
                    for stmt, params in statements:
                        cur = await conn.execute(stmt, params)
                        changed.extend(row[0] for row in await cur.fetchall())
                    kept = set(changed)
                    pairs = [
                        (task, decision)
                        for i, task, decision in zip(claim.ids, claim.items, decisions, strict=True)
                        if i in kept
                    ]
                    extra = on_settle(pairs) if pairs else None
                    if extra is not None:
                        await conn.execute(extra[0], extra[1])
                    return changed

            async with self._settle_lock:
                return await self.within(conn, "settle", settle())
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc

    async def _run(self, stmt: str, params: Sequence[Any]) -> list[int]:
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:
                rows = await self.within(conn, "settle", fetch_rows(conn.cursor(), stmt, params))
                return [row[0] for row in rows]
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc

    async def fail_unhandled(self, grace: float, limit: int) -> list[str]:
        """Fail due tasks of names this worker has no handler for that no worker claimed
        within ``grace`` seconds (one batch); the names of those failed."""
        params = {"grace": grace, "queues": self.queues, "names": self.names or [],
                  "limit": limit}  # fmt: skip
        rows = await self._sweeping(
            "settle", lambda conn: fetch_rows(conn.cursor(), self.sql.fail_unhandled, params)
        )
        return [str(row[0]) for row in rows]

    async def _sweeping(
        self,
        what: str,
        work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[_R]],
        *,
        sweep: bool = True,
    ) -> _R:
        """A sweep's ``work`` on the settle connection, or while parked (a fleet's idle
        database, PgSession) on the LISTEN session: an idle database's sweeps, every second,
        then keep no settle connection open. ``sweep=False``: the settle connection."""
        listen = self._listen_conn
        if sweep and self._parked and listen is not None and not listen.closed:
            result: _R = await self._on_listen(what, work)  # (its errors translated)
            return result
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:
                return await self.within(conn, what, work(conn))
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc

    async def _count(self, stmt: str, params: Sequence[Any], what: str) -> int:
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:
                cur = conn.cursor()
                await self.within(conn, what, cur.execute(stmt, params))
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        return cur.rowcount

    async def extend_leases(self, claim: Claim[ClaimedTask], lease: float) -> int:
        self.lease = lease
        return await self._count(
            self.sql.extend, (lease, claim.ids, claim.token), "lease heartbeat"
        )

    async def release(self, claim: Claim[ClaimedTask]) -> int:
        ids = [i for i, t in zip(claim.ids, claim.items, strict=True) if not t.completed]
        return await self._count(self.sql.release, (ids, claim.token), "release") if ids else 0

    async def hasten(self, ids: Sequence[int]) -> int:
        return await self._count(self.sql.hasten, (list(ids),), "hasten") if ids else 0

    # -- a handler's own transaction (ctx.transaction()), completed fenced ---------------

    @contextlib.contextmanager
    def transaction(self, label: str) -> Iterator[psycopg.Connection[Any]]:
        conn = connect(self.dsn, application_name=f"{self.name}:{label}"[:63],
                       autocommit=False, pooler=self.pooler)  # fmt: skip
        try:
            yield conn
        finally:
            conn.close()  # (rolls back whatever was not committed)

    @contextlib.asynccontextmanager
    async def atransaction(self, label: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        conn = await aconnect(self.dsn, application_name=f"{self.name}:{label}"[:63],
                              autocommit=False, pooler=self.pooler)  # fmt: skip
        try:
            yield conn
        finally:
            await conn.close()

    def _completion(
        self, task_id: int, token: uuid.UUID, keep: float | None, progress: str | None
    ) -> tuple[str, tuple[Any, ...]]:
        if keep is None:
            return self._complete, (task_id, token)
        return self.sql.complete_kept, (keep, progress, task_id, token)

    def complete(
        self,
        conn: psycopg.Connection[Any],
        task_id: int,
        token: uuid.UUID,
        keep: float | None = None,
        progress: str | None = None,
    ) -> bool:
        stmt = self._completion(task_id, token, keep, progress)
        return conn.execute(*stmt).fetchone() is not None

    async def acomplete(
        self,
        conn: psycopg.AsyncConnection[Any],
        task_id: int,
        token: uuid.UUID,
        keep: float | None = None,
        progress: str | None = None,
    ) -> bool:
        cur = await conn.execute(*self._completion(task_id, token, keep, progress))
        return await cur.fetchone() is not None


# -- periodic tasks (the worker's side task, outboxkit.tasks.periodic) ---------------------


@contextlib.contextmanager
def _schedules_errors() -> Iterator[None]:
    """psycopg's errors as the port's StoreError (the periodic loop knows no driver)."""
    try:
        yield
    except psycopg.Error as exc:
        raise StoreError(first_line(exc), cause=exc) from exc


class PgSchedules:
    """The schedules table, as the periodic side task uses it (one connection, autocommit).

    Made for a transaction pooler as well: every call is one autocommit statement or one
    transaction (the slot and its task), nothing is kept in the session (no lock, no
    ``SET``; one run per slot is the table's primary key, not a leader's lock), and behind
    ``pooler`` (the worker's ``--pooler``, else what the DSN says or the first connection
    finds) no named prepared statement where the pooler loses it.
    """

    def __init__(
        self,
        dsn: str,
        table: str,
        name: str = "outboxkit-worker",
        *,
        pooler: PoolerMode | None = None,
    ) -> None:
        self.dsn = dsn
        self.sql = TaskStatements(table)
        self.name = name
        self.pooler = pooler
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await aconnect(
                self.dsn, application_name=f"{self.name}:periodic", pooler=self.pooler
            )
        return self._conn

    async def now(self) -> dt.datetime:
        """The database's clock (every worker reads the same one)."""
        with _schedules_errors():
            conn = await self._connection()
            row = await (await conn.execute(self.sql.database_now)).fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    async def last_slot(self, schedule: str) -> tuple[dt.datetime | None, dt.datetime]:
        """The latest slot recorded for ``schedule`` (None: never ran), and the database's now."""
        with _schedules_errors():
            conn = await self._connection()
            row = await (await conn.execute(self.sql.last_slot, (schedule,))).fetchone()
        assert row is not None
        return row[0], row[1]

    async def enqueue(
        self, schedule: str, slot: dt.datetime, name: str, queue: str, payload: str, priority: int
    ) -> int | None:
        """Insert the slot and its task in one transaction; the task id, None if taken."""
        params = {"schedule": schedule, "slot": slot, "name": name, "queue": queue,
                  "payload": payload, "priority": priority}  # fmt: skip
        with _schedules_errors():
            conn = await self._connection()
            async with conn.transaction():
                row = await (await conn.execute(self.sql.enqueue_periodic, params)).fetchone()
                if row is None:
                    return None
                await conn.execute(self.sql.set_slot_task, (row[0], schedule, slot))
        return int(row[0])

    async def prune(self, keep: float, limit: int) -> int:
        """Delete up to ``limit`` slots older than ``keep`` seconds (each schedule's newest
        stays); the number deleted."""
        with _schedules_errors():
            conn = await self._connection()
            cur = await conn.execute(self.sql.prune_slots, {"keep": keep, "limit": limit})
        return cur.rowcount

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = None


# -- ops: the `outboxkit tasks` commands and the dashboard (short autocommit statements) ----
# ``dsn`` may be an open autocommit connection (the dashboard's own, kept), used and left open.
_Source = str | psycopg.Connection[Any]


def _admin(dsn: _Source, table: str) -> Any:
    def missing() -> Exception:
        return SchemaError(
            f"task table {table!r} not found: run `outboxkit migrate --tasks --dsn ..."
            f" --tasks-table {table}`"
        )

    return admin_connection(dsn, missing)


def list_tasks(
    dsn: _Source,
    table: str,
    *,
    status: TaskStatus | None = None,
    name: str | None = None,
    queue: str | None = None,
    due: bool | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Tasks by id (oldest first), optionally of one state, task name and queue.

    ``due``: only tasks whose ``available_at`` has come (True) or not (False); with
    status pending, that is queued (True) or scheduled (False).
    """
    stmts = TaskStatements(table)
    params = {"status": None if status is None else int(status), "name": name,
              "queue": queue, "due": due, "limit": limit}  # fmt: skip
    with _admin(dsn, table) as conn, conn.cursor(row_factory=dict_row) as cur:
        return list(cur.execute(stmts.list_tasks, params).fetchall())


def task_gauges(
    dsn: _Source, table: str, *, max_names: int = DEFAULT_MAX_TASK_NAMES
) -> list[tuple[Any, ...]]:
    """Per task name: queued, scheduled, running, failed, oldest queued age (s) or None.

    The ``max_names`` names with the most tasks get a row each; the rest are summed in one
    row named ``(other)`` (:data:`OTHER_TASKS`), so a scrape's series stay bounded.
    """
    if max_names < 0:
        raise ValueError("the number of task names with gauges cannot be negative")
    params = {"max_names": max_names, "other": OTHER_TASKS}
    with _admin(dsn, table) as conn:
        return list(conn.execute(TaskStatements(table).task_gauges, params).fetchall())


def show_task(dsn: _Source, table: str, task_id: int) -> dict[str, Any] | None:
    """Every column of one task (its payload as JSON text), or None."""
    with _admin(dsn, table) as conn, conn.cursor(row_factory=dict_row) as cur:
        # The payload stays text: a row written around enqueue() may not load (3 000
        # levels of nesting raised RecursionError here); callers show payload_json.
        set_json_loads(_raw_json, cur)
        row: dict[str, Any] | None = cur.execute(
            TaskStatements(table).show_task, (task_id,)
        ).fetchone()
        return row


def replay_tasks(
    dsn: _Source, table: str, ids: Sequence[int] = (), *, all_failed: bool = False,
    name: str | None = None,
) -> list[int]:  # fmt: skip
    """Failed or cancelled tasks back to pending, attempts from zero; the ids replayed."""
    return replay_tasks_reporting(dsn, table, ids, all_failed=all_failed, name=name)[0]


def replay_tasks_reporting(
    dsn: _Source, table: str, ids: Sequence[int] = (), *, all_failed: bool = False,
    name: str | None = None,
) -> tuple[list[int], list[tuple[int, str]]]:  # fmt: skip
    """As :func:`replay_tasks`, and the tasks left failed with their unique_key: a live task
    holds it now (or a newer failed task of that key was replayed instead)."""
    params = {"ids": list(ids), "all": all_failed, "name": name}
    with _admin(dsn, table) as conn:
        for attempt in range(3):
            try:
                with conn.transaction():
                    rows = conn.execute(TaskStatements(table).replay_tasks, params).fetchall()
                break
            except pg_errors.UniqueViolation:  # a task enqueued with that key meanwhile
                if attempt == 2:
                    raise
    replayed = [int(i) for i, key in rows if key is None]
    skipped = [(int(i), str(key)) for i, key in rows if key is not None]
    return replayed, skipped


def cancel_tasks(dsn: _Source, table: str, ids: Sequence[int]) -> list[int]:
    """Pending or running tasks cancelled (a running one's completion becomes a no-op)."""
    with _admin(dsn, table) as conn:
        return [r[0] for r in conn.execute(TaskStatements(table).cancel_tasks, (list(ids),))]


def discard_tasks(dsn: _Source, table: str, ids: Sequence[int]) -> list[int]:
    """Failed or cancelled tasks deleted for good."""
    with _admin(dsn, table) as conn:
        return [r[0] for r in conn.execute(TaskStatements(table).discard_tasks, (list(ids),))]


def pause_queue(dsn: _Source, table: str, queue: str, *, by: str | None = None) -> bool:
    """Stop every worker claiming from ``queue`` (running tasks finish; enqueue goes on);
    False if it was paused already."""
    with _admin(dsn, table) as conn:
        row = conn.execute(TaskStatements(table).pause_queue, {"queue": queue, "by": by}).fetchone()
    return not (row is not None and row[0])


def resume_queue(dsn: _Source, table: str, queue: str, *, by: str | None = None) -> bool:
    """Let workers claim from ``queue`` again, woken at once; False if it was not paused."""
    stmts = TaskStatements(table)
    params = {"queue": queue, "by": by, "channel": stmts.channel}
    with _admin(dsn, table) as conn:
        row = conn.execute(stmts.resume_queue, params).fetchone()
    return bool(row is not None and row[0])


def queue_states(dsn: _Source, table: str) -> list[dict[str, Any]]:
    """Every queue with live tasks or a pause record: paused, since when and by whom, and
    its queued and running counts."""
    with _admin(dsn, table) as conn, conn.cursor(row_factory=dict_row) as cur:
        return list(cur.execute(TaskStatements(table).queue_states).fetchall())


def purge_finished(dsn: str, table: str, *, older_than: float, batch_size: int = 1000) -> int:
    """Delete done and cancelled tasks finished over ``older_than`` seconds ago, in batches."""
    stmt = TaskStatements(table).purge_finished
    total = 0
    with _admin(dsn, table) as conn:
        while True:
            deleted = int(conn.execute(stmt, {"age": older_than, "limit": batch_size}).rowcount)
            total += deleted
            if deleted < batch_size:
                return total


# -- results: Tasks.result() / wait() / await_result() -------------------------------------

#: Tasks.wait() looks again after this long without a notification, doubling up to
#: WAIT_POLL_CAP: behind a transaction pooler (no LISTEN) polling is all there is.
WAIT_POLL_FIRST = 0.05
WAIT_POLL_CAP = 1.0


def read_result(source: _Source, table: str, task_id: int) -> dict[str, Any] | None:
    """One task's state, value, error, progress and timings (``READ_RESULT``), or None."""
    with _admin(source, table) as conn, conn.cursor(row_factory=dict_row) as cur:
        row: dict[str, Any] | None = cur.execute(
            TaskStatements(table).read_result, (task_id,)
        ).fetchone()
        return row


def wait_result(source: _Source, table: str, task_id: int, timeout: float) -> dict[str, Any]:
    """The task's row once finished: woken by its completion's notification (LISTEN), else
    looking again with backoff (behind a pooler); TimeoutError naming its last state."""
    stmts = TaskStatements(table)
    if isinstance(source, psycopg.Connection) and not source.autocommit:
        raise TypeError(
            "Tasks.wait() needs a DSN or an autocommit connection: it listens for the"
            " completion between transactions, which an open transaction would hold back"
        )
    deadline = time.monotonic() + timeout
    wanted = str(task_id)
    listen = sql.SQL("LISTEN {}").format(sql.Identifier(stmts.results_channel))
    with _admin(source, table) as conn:
        conn.execute(listen)
        try:
            poll = WAIT_POLL_FIRST
            while True:
                with conn.cursor(row_factory=dict_row) as cur:
                    row: dict[str, Any] | None = cur.execute(
                        stmts.read_result, (task_id,)
                    ).fetchone()
                if row is None:
                    raise task_gone(task_id)
                if task_finished(row):
                    return row
                left = deadline - time.monotonic()
                if left <= 0:
                    raise task_late(task_id, timeout, row)
                for note in conn.notifies(timeout=min(poll, left)):
                    if note.payload == wanted:
                        break
                poll = min(poll * 2, WAIT_POLL_CAP)
        finally:
            if not conn.closed and isinstance(source, psycopg.Connection):
                conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(stmts.results_channel)))


async def await_result(
    source: str | psycopg.AsyncConnection[Any],
    table: str,
    task_id: int,
    timeout: float,  # noqa: ASYNC109 (the twin of wait_result's signature)
) -> dict[str, Any]:
    """:func:`wait_result` for asyncio: a DSN or an autocommit ``AsyncConnection``."""
    stmts = TaskStatements(table)
    if isinstance(source, psycopg.AsyncConnection) and not source.autocommit:
        raise TypeError(
            "Tasks.await_result() needs a DSN or an autocommit connection: it listens for the"
            " completion between transactions, which an open transaction would hold back"
        )
    deadline = time.monotonic() + timeout
    wanted = str(task_id)
    channel = sql.Identifier(stmts.results_channel)
    own = not isinstance(source, psycopg.AsyncConnection)
    conn = (
        await aconnect(source, application_name="outboxkit:wait")
        if isinstance(source, str)
        else source
    )
    try:
        await conn.execute(sql.SQL("LISTEN {}").format(channel))
        poll = WAIT_POLL_FIRST
        while True:
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(stmts.read_result, (task_id,))
                row = await cur.fetchone()
            if row is None:
                raise task_gone(task_id)
            if task_finished(row):
                found: dict[str, Any] = row
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise task_late(task_id, timeout, row)
            async for note in conn.notifies(timeout=min(poll, left)):
                if note.payload == wanted:
                    break
            poll = min(poll * 2, WAIT_POLL_CAP)
    except pg_errors.UndefinedTable:
        raise SchemaError(
            f"task table {table!r} not found: run `outboxkit migrate --tasks --dsn ..."
            f" --tasks-table {table}`"
        ) from None
    finally:
        if own:
            await conn.close()
        elif not conn.closed:
            await conn.execute(sql.SQL("UNLISTEN {}").format(channel))
