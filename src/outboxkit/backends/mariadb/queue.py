"""MariaDB's implementation of the queue store (outboxkit.queue.store.QueueStore), on aiomysql.

Two connections, one for claims and one for settles (session.py: READ COMMITTED,
``CLIENT.FOUND_ROWS``). The claim is a short transaction: lock a batch with ``FOR UPDATE
SKIP LOCKED``, lease it, read it back, commit. No transaction is held while the sink works.

No LISTEN/NOTIFY on MariaDB: the loop polls, and outboxkit's writers in the relay's own
process wake it (``wakeup``).
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, TypeVar

import orjson

from outboxkit.backends.mariadb import sql
from outboxkit.backends.mariadb.ordered_sql import (
    SCAN_FACTOR,
    OrderedStatements,
    expand,
    scan_query,
)
from outboxkit.backends.mariadb.session import NO_INDEX, NO_TABLE, GatedSession, micros
from outboxkit.backends.mariadb.sql import Statements, with_ids
from outboxkit.errors import ConfigurationError, SchemaError, table_missing
from outboxkit.queue.settle import group_decisions
from outboxkit.queue.store import (
    Attempted,
    Claim,
    ClaimPolicy,
    Decision,
    HeadsOnly,
    Settled,
    StoreInfo,
)

log = logging.getLogger("outboxkit.relay")
T = TypeVar("T", bound=Attempted)
Retention = Literal["delete", "keep"]
PENDING_CAP = 100_000


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    return None if value is None else value.replace(tzinfo=dt.UTC)


def _looped_error(attempts: int, token: str | None, last: str | None, limit: int) -> str:
    """The last_error of a row the crash-loop guard dead-letters (PostgreSQL's words)."""
    if token is not None:
        text = (
            f"relay: claimed {attempts} times (max_attempts) and never settled: each relay"
            " that claimed it died or hung publishing it (a message that crashes or hangs the"
            " relay, an OOM?). Dead-lettered without publishing it again: inspect it with"
            " `outboxkit failed show`, then replay or discard it"
        )
    else:
        text = (
            f"relay: tried {attempts} times already, as many as this relay's max_attempts"
            f" ({limit}): a relay with a higher max_attempts retried it before. Dead-lettered"
            " without publishing it again: give the relays one --max-attempts, then replay it"
        )
    return text if last is None else f"{text}. Last error: {last[:1000]}"


class MariaDBQueueStore(GatedSession, Generic[T]):
    """An outbox table on MariaDB/MySQL as a queue store; ``make_item`` builds an item from a
    claimed row's columns after the id (``OutboundMessage`` for the outbox).

    ``ordered``: the table has ordered mode's partitions (``migrate --ordered``); a
    :class:`HeadsOnly` claim runs the ordered claim and every settle, extension and release
    is also fenced by the claimer's partition lease.
    """

    def __init__(
        self,
        dsn: str,
        table: str,
        make_item: Callable[..., T],
        *,
        retention: Retention = "delete",
        ordered: bool = False,
        name: str = "outboxkit-relay",
    ) -> None:
        super().__init__(dsn, table)
        self.table = table
        self.make_item = make_item
        self.retention: Retention = retention
        self.ordered = ordered
        #: Ordered mode's statements (HeadsOnly claims, settles fenced by partition leases).
        self.ordered_sql = OrderedStatements(table) if ordered else None
        self.name = name
        self.sql = Statements(table)
        self._told_polling = False
        #: Ordered mode's partition count P, read at the first ordered claim (it chooses the
        #: scan's plan; P changes only with every relay stopped: migrate --repartition).
        self._partition_total: int | None = None

    def __repr__(self) -> str:
        return f"MariaDBQueueStore(table={self.table!r})"

    def _schema_error(self, code: int, reason: str) -> Exception | None:
        if code == NO_TABLE:
            return table_missing(self.table, database=self._args["database"])
        if code == NO_INDEX:
            ordered = " --ordered" if self.ordered else ""
            return SchemaError(
                f"outbox table {self.table!r} lacks an index this relay's claim reads"
                f" ({reason}): upgrade its schema with `outboxkit migrate{ordered} --dsn …"
                f" --table {self.table}`"
            )
        return None

    # -- start ----------------------------------------------------------------------------

    async def start(self) -> StoreInfo:
        """Check the table and its columns; say once that the relay polls."""

        async def check(cur: Any) -> int:
            await cur.execute(self.sql.count_pending_capped, (PENDING_CAP,))
            (pending,) = await cur.fetchone()
            await cur.execute(self.sql.check_columns)
            return int(pending)

        pending = await self._run("claim", check)
        if not self._told_polling:
            self._told_polling = True
            log.info(
                "MariaDB has no LISTEN/NOTIFY: the relay polls (writers in its own process wake it)"
            )
        where = f"database {self._args['database']} on {self._args['host']} (MariaDB)"
        return StoreInfo(pending, pending >= PENDING_CAP, where)

    # -- claim ------------------------------------------------------------------------------

    async def claim(
        self,
        *,
        limit: int,
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
        policy: ClaimPolicy = None,
    ) -> Claim[T] | None:
        if policy is not None and self.ordered_sql is None:
            raise ConfigurationError(
                "an ordered claim needs the store built with ordered=True (migrate --ordered)"
            )

        async def run(cur: Any) -> Claim[T] | None:
            await cur.execute("BEGIN")
            if isinstance(policy, HeadsOnly):
                locked = await self._lock_heads(cur, limit, owner, policy)
            else:
                await cur.execute(self.sql.claim_lock, (limit,))
                locked = [(r[0], None, *r[1:]) for r in await cur.fetchall()]
            if not locked:
                await cur.execute("COMMIT")
                return None
            return await self._take(cur, locked, lease, token, owner, max_attempts, policy)

        return await self._run("claim", run)  # type: ignore[no-any-return]

    async def _lock_heads(
        self, cur: Any, limit: int, owner: str, policy: HeadsOnly
    ) -> list[tuple[Any, ...]]:
        """Ordered mode's claim, up to the lock: per key, a prefix of its rows in id order
        whose earlier rows are all settled (or in this batch), in partitions this relay
        leases; then keyless rows as in the unordered claim. Rows as (id, key, attempts,
        claim_token, last_error)."""
        o = self.ordered_sql
        assert o is not None
        await cur.execute(o.my_partitions, (owner, micros(policy.margin)))
        draining = set(policy.draining)
        parts = [r[0] for r in await cur.fetchall() if r[0] not in draining]
        keyed: list[tuple[Any, ...]] = []
        if parts:
            if self._partition_total is None:
                await cur.execute(o.partition_count)
                self._partition_total = int((await cur.fetchone())[0])
            await cur.execute(*scan_query(o, parts, SCAN_FACTOR * limit, self._partition_total))
            scanned = list(await cur.fetchall())
            if scanned:
                # Due earlier rows of a key are among the scanned ones: only rows not due
                # (in flight, waiting for a retry) or dead-lettered block it here.
                first = await self._blockers(cur, scanned, [], policy.block)
                chosen = [(i, k) for i, k in scanned if i < first.get(k, i + 1)][:limit]
                keyed = await self._lock_prefixes(cur, chosen, policy.block) if chosen else []
        await cur.execute(o.lock_keyless, (max(limit - len(keyed), limit // 4),))
        return keyed + list(await cur.fetchall())

    async def _lock_prefixes(
        self, cur: Any, chosen: list[tuple[int, str]], block: bool
    ) -> list[tuple[Any, ...]]:
        """Lock the chosen rows; keep of each key the rows before its first one missed.

        The lock skips rows another claim holds; each statement here reads its own
        snapshot, so after the lock every earlier unsettled row of the key (outside this
        batch) is looked for again, and the key's rows from there on are left.
        """
        o = self.ordered_sql
        assert o is not None
        await cur.execute(expand(o.lock_chosen, ids=len(chosen)), [i for i, _ in chosen])
        locked = list(await cur.fetchall())
        got = {r[0] for r in locked}
        missing: dict[str, int] = {}
        for i, k in chosen:
            if i not in got and k not in missing:
                missing[k] = i
        locked = [r for r in locked if r[0] < missing.get(r[1], r[0] + 1)]
        if not locked:
            return []
        first = await self._blockers(cur, [(r[0], r[1]) for r in locked], locked, block)
        return [r for r in locked if r[0] < first.get(r[1], r[0] + 1)]

    async def _blockers(
        self, cur: Any, rows: list[tuple[int, str]], held: list[tuple[Any, ...]], block: bool
    ) -> dict[str, int]:
        """Per key of ``rows``, the id of its first earlier row that blocks it: one not
        settled and not in ``held`` (when ``held`` is empty: not due, or dead-lettered)."""
        o = self.ordered_sql
        assert o is not None
        keys = sorted({k for _, k in rows})
        exclude = [r[0] for r in held] or [0]
        statement = expand(o.blockers, keys=len(keys), ids=len(exclude))
        bound = max(i for i, _ in rows)
        statuses = (sql.PENDING, sql.FAILED if block else sql.PENDING)
        await cur.execute(statement, (*keys, *statuses, bound, *exclude, bool(held), block))
        return {k: int(i) for k, i in await cur.fetchall()}

    async def _take(
        self,
        cur: Any,
        locked: list[tuple[Any, ...]],
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
        policy: ClaimPolicy,
    ) -> Claim[T]:
        """Lease the locked rows (id, key, attempts, claim_token, last_error), dead-letter
        the crash-looped ones, read the leased ones back, commit.

        Ordered, under ``block``: a key's rows after its dead-lettered one stay pending.
        """
        sq = self.sql
        dead_rows = [(r[0], r[2], r[3], r[4]) for r in locked if r[2] >= max_attempts]
        first_dead: dict[str, int] = {}
        if isinstance(policy, HeadsOnly) and policy.block:
            for r in locked:
                if r[1] is not None and r[2] >= max_attempts and r[1] not in first_dead:
                    first_dead[r[1]] = r[0]
        live = [
            r[0]
            for r in locked
            if r[2] < max_attempts and (r[1] is None or r[0] < first_dead.get(r[1], r[0] + 1))
        ]
        records: list[Any] = []
        dead: list[tuple[T, str, str]] = []
        if live:
            await cur.execute(
                with_ids(sq.claim_lease, len(live)), (micros(lease), str(token), owner, *live)
            )
            await cur.execute(with_ids(sq.claim_read, len(live)), live)
            records = list(await cur.fetchall())
        if dead_rows:
            dead = await self._dead_letter(cur, dead_rows, owner, max_attempts)
        await cur.execute("COMMIT")
        make = self.make_item
        items = [
            make(
                uuid.UUID(r[1]), r[2], r[3], r[4], r[5], r[6], bytes(r[7]),
                orjson.loads(r[8]), _utc(r[9]), r[10], _utc(r[11]), r[12],
            )
            for r in records
        ]  # fmt: skip
        return Claim(token, [r[0] for r in records], items, dead or None)

    async def _dead_letter(
        self, cur: Any, rows: list[Any], owner: str, max_attempts: int
    ) -> list[tuple[T, str, str]]:
        """The crash-loop guard: each row gets its own error (claimed and never settled, or
        retried up to a higher max_attempts before); reported without its payload."""
        errors: dict[int, str] = {}
        for row_id, attempts, token, last in rows:
            errors[row_id] = _looped_error(attempts, token, last, max_attempts)
            await cur.execute(with_ids(self.sql.claim_dead, 1), (owner, errors[row_id], row_id))
        ids = [r[0] for r in rows]
        await cur.execute(with_ids(self.sql.claim_read_dead, len(ids)), ids)
        make = self.make_item
        found = []
        for row_id, event_id, topic, event_type, created, attempts in await cur.fetchall():
            when = _utc(created)
            item = make(
                uuid.UUID(event_id), topic, None, event_type, None, None, b"", {}, when,
                attempts, when, None,
            )  # fmt: skip
            kind = "crash_loop" if errors[row_id].startswith("relay: claimed") else "max_attempts"
            found.append((item, kind, errors[row_id]))
        return found

    # -- settle -----------------------------------------------------------------------------

    async def settle(self, claim: Claim[T], decisions: Sequence[Decision]) -> Settled:
        ids = claim.ids
        token = str(claim.token)
        sq = self.sql
        keep = self.retention == "keep"
        groups = group_decisions(claim, decisions)
        o = self.ordered_sql
        fence = sq.fenced_ids + " FOR UPDATE" if o is None else o.fenced_ids

        async def run(cur: Any) -> list[int]:
            await cur.execute("BEGIN")
            await cur.execute(with_ids(fence, len(ids)), (*ids, token))
            held = {r[0] for r in await cur.fetchall()}
            mine = [i for i in groups.done if i in held]
            if mine:
                stmt = sq.settle_published_keep if keep else sq.settle_published_delete
                await cur.execute(with_ids(stmt, len(mine)), (*mine, token))
            failures = [
                (sql.FAILED if dead else sql.PENDING, micros(delay), error, int(refund), i, token)
                for i, dead, delay, error, refund in groups.failures()
                if i in held
            ]
            if failures:
                await cur.executemany(sq.settle_failure, failures)
            await cur.execute("COMMIT")
            return [i for i in ids if i in held]

        done: list[int] = await self._run("settle", run)
        return Settled(done, len(ids) - len(done))

    async def _fenced(self, statement: str, params: tuple[Any, ...]) -> int:
        async def run(cur: Any) -> int:
            await cur.execute(statement, params)
            return int(cur.rowcount)

        return await self._run("settle", run)  # type: ignore[no-any-return]

    async def extend_leases(self, claim: Claim[T], lease: float) -> int:
        o = self.ordered_sql
        statement = with_ids((o or self.sql).extend_leases, len(claim.ids))
        return await self._fenced(statement, (micros(lease), *claim.ids, str(claim.token)))

    async def release(self, claim: Claim[T]) -> int:
        o = self.ordered_sql
        statement = with_ids((o or self.sql).release_leases, len(claim.ids))
        return await self._fenced(statement, (*claim.ids, str(claim.token)))

    async def hasten(self, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        return await self._fenced(with_ids(self.sql.hasten_handed_back, len(ids)), tuple(ids))
