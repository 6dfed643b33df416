"""PostgreSQL's implementation of the queue store (outboxkit.queue.store.QueueStore).

It runs the named statements of backends/postgres/postgres.py (and, for the ordered claim policy,
backends/postgres/ordered_sql.py) on two autocommit connections, one for claims and one for
settles. The connections, the wake-up gate, LISTEN, the pooler's rules and the turning of
psycopg's errors into the store interface's are backends/postgres/_pg_session.py's (shared with task
mode's store).
"""

from __future__ import annotations

import asyncio
import logging
import operator
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, TypeVar

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.pq import Format

from outboxkit.backends.postgres._connection import PoolerMode
from outboxkit.backends.postgres._pg_session import PgSession, fetch_rows
from outboxkit.backends.postgres.ordered_sql import OrderedStatements
from outboxkit.backends.postgres.postgres import SESSION_UTC, Statements, Status
from outboxkit.errors import (
    SchemaError,
    relay_schema_outdated,
    table_missing,
)
from outboxkit.queue.settle import group_decisions
from outboxkit.queue.store import (
    DONE,
    Attempted,
    Claim,
    ClaimPolicy,
    Decision,
    HeadsOnly,
    Settled,
    StoreDenied,
    StoreError,
    StoreInfo,
    StoreTimeout,
    StoreUnavailable,
)

log = logging.getLogger("outboxkit.relay")

T = TypeVar("T", bound=Attempted)

Retention = Literal["delete", "keep"]
#: The start-up count of pending events stops here: it reads the pending index only.
PENDING_CAP = 100_000

_new = object.__new__
_set = object.__setattr__
_UNKNOWN = uuid.SafeUUID.unknown


class UuidBinaryLoader(Loader):
    """A binary ``uuid`` column as ``uuid.UUID``, built without ``UUID.__init__``.

    psycopg's loader calls ``UUID(bytes=...)``, whose argument checks cost more than the
    rest of the event id's decoding: measured 4.1 -> 1.6 µs per id (1 000 ids, median of
    15 interleaved rounds, loaded machine). The result is an ordinary ``UUID`` (same
    ``int``, equality, hash, text), as ``UUID.__init__`` leaves it for 16 bytes.
    """

    format = Format.BINARY

    def load(self, data: Buffer) -> uuid.UUID:
        value: uuid.UUID = _new(uuid.UUID)
        _set(value, "int", int.from_bytes(data, "big"))
        _set(value, "is_safe", _UNKNOWN)
        return value


class JsonLoader(Loader):
    """A binary ``json`` column by orjson, called by psycopg's row loop directly.

    The claim returns the headers as ``json`` (backends/postgres/postgres.py CLAIM_RETURNING), whose
    binary form is the text itself, so ``load`` can be orjson's function: no Python frame
    per row, no version byte to strip as for ``jsonb``. Measured on 1 000 claimed rows
    (``bench/micro_claim_decode.py``, docs/benchmarks.md round 3, fourth session):
    the claim's client CPU 10.4 -> 8.9 µs per row.
    """

    format = Format.BINARY
    load = staticmethod(orjson.loads)  # type: ignore[assignment]  # (a builtin: same call)


#: The ordered claim looks at this many times the batch size of pending keyed rows.
SCAN_FACTOR = 4

_ROW_ID = operator.itemgetter(0)


def _dead_class(error: str) -> str:
    """The kind of a dead letter the claim made, from the error it stored
    (backends/postgres/postgres.py)."""
    if error.startswith("relay: claimed"):
        return "crash_loop"
    if error.startswith("relay: tried"):
        return "max_attempts"
    return "oversized"


class PgQueueStore(PgSession, Generic[T]):
    """An outbox table as a queue store. ``make_item`` builds an item from a claimed row's
    columns after the id (the claim's RETURNING order: ``OutboundMessage`` for the outbox).

    ``ordered``: the table has ordered mode's partitions; settles are also fenced by the
    partition lease, and a :class:`HeadsOnly` claim runs the ordered claim.
    ``synchronous_commit`` False: claims and settles commit without waiting for the WAL
    flush (a database crash can then cause re-publication, never loss).

    Behind a transaction pooler (``pooler``, or found by the connection factory) claims
    and settles work as they are (single statements, ``SET LOCAL`` only); what needs a
    session (LISTEN, the wake-up gate's lock) runs on ``direct_dsn`` (PostgreSQL itself)
    or not at all: the poll still finds every event.
    """

    # Its claim and settles are planned once per connection (PgSession.generic_plans): at
    # the steady rates production runs, a claim finds a few events, and re-planning the
    # claim at each execution cost more than running it (bench/relay_claim_plans.py: a
    # claim and settle of 2 events 769 us with custom plans, 380 us generic).
    generic_plans = True

    def __init__(
        self,
        dsn: str,
        table: str,
        make_item: Callable[..., T],
        *,
        retention: Retention = "delete",
        ordered: bool = False,
        synchronous_commit: bool = False,
        name: str = "outboxkit-relay",
        pooler: PoolerMode | None = None,
        direct_dsn: str | None = None,
    ) -> None:
        self.sql: Statements = OrderedStatements(table) if ordered else Statements(table)
        sq = self.sql
        super().__init__(
            dsn,
            name=name,
            pooler=pooler,
            direct_dsn=direct_dsn,
            channel=sq.channel,
            try_wake_lock=sq.try_wake_lock,
            wake_unlock=sq.wake_unlock,
            log=log,
            who="relay",
            what="events",
            due_in=sq.due_in,
        )
        # Plans without sequential scans (PgSession.index_plans); not in ordered mode, whose
        # claim (a scan by partition, keys' blockers) was not measured with them.
        self.index_plans = not ordered
        self.table = table
        self.make_item = make_item
        self.retention: Retention = retention
        self.ordered = ordered
        self._commit: str | None = None if synchronous_commit else "off"
        # Ordered mode's settles are fenced by the partition lease too (same parameters).
        if isinstance(sq, OrderedStatements):
            self._published_delete = sq.fenced_settle_published_delete
            self._published_keep = sq.fenced_settle_published_keep
            self._failures = sq.fenced_settle_failures
            self._release = sq.fenced_release_leases
            self._extend = sq.fenced_extend_leases
        else:
            self._published_delete = sq.settle_published_delete
            self._published_keep = sq.settle_published_keep
            self._failures = sq.settle_failures
            self._release = sq.release_leases
            self._extend = sq.extend_leases
        self._cursors: dict[str, psycopg.AsyncCursor[Any]] = {}
        self._settle_lock = asyncio.Lock()
        # Settles of a claim whose published part committed before its failures' statement
        # was lost: a retry settles only the rest (the fence would call the rows lost).
        self._partial: dict[uuid.UUID, list[int]] = {}

    def __repr__(self) -> str:
        return f"PgQueueStore(table={self.table!r})"

    # -- start ----------------------------------------------------------------------

    async def start(self) -> StoreInfo:
        """Check the table, its columns and this role's rights to settle."""
        try:
            conn = await self._connection("claim")
            cur = await conn.execute(self.sql.count_pending_capped, {"cap": PENDING_CAP})
            row = await cur.fetchone()
            pending = int(row[0]) if row else 0
            await conn.execute(self.sql.check_columns)
            cur = await conn.execute(self.sql.check_write_rights)
            rights = await cur.fetchone()
        except pg_errors.UndefinedTable:
            database = self._claim_conn.info.dbname if self._claim_conn else None
            raise table_missing(self.table, database=database) from None
        except pg_errors.UndefinedColumn as exc:
            raise (relay_schema_outdated(exc, self.table) or exc) from None
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        if rights is not None:
            update, delete, read_only = rights
            missing = [p for p, ok in (("UPDATE", update), ("DELETE", delete)) if not ok]
            if self.retention == "keep" and "DELETE" in missing:
                missing.remove("DELETE")
            if read_only or missing:
                what = (
                    "the server is read-only (a standby, or default_transaction_read_only)"
                    if read_only
                    else f"the role {conn.info.user!r} lacks {' and '.join(missing)}"
                    f" on {self.table}"
                )
                cause = pg_errors.InsufficientPrivilege(f"cannot settle: {what}")
                raise StoreDenied(str(cause), cause=cause)
        if self.direct_dsn is not None:
            try:
                await self._direct()
            except psycopg.Error as exc:
                raise await self._translate(exc) from exc
        elif not self.session_state:
            self._tell_pooled()
        return StoreInfo(
            pending,
            pending >= PENDING_CAP,
            f"database {conn.info.dbname} on {conn.info.host}",
        )

    # -- claim ------------------------------------------------------------------------

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
        claim, _settled = await self._claim(limit, lease, token, owner, max_attempts, policy)
        return claim

    @property
    def carries_settles(self) -> bool:
        """Whether a claim may carry the settle of the claim before it (queue/carry.py): not
        in ordered mode, whose settles are fenced by the partition lease too."""
        return not self.ordered

    async def claim_settling(
        self,
        carried: Claim[T],
        *,
        limit: int,
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
    ) -> tuple[Claim[T] | None, Settled | None]:
        """Claim as :meth:`claim` does and, in the same statement, settle ``carried`` (every
        item published) as :meth:`settle` would: one statement and one commit for both.
        Settled None: no statement ran (the claim connection is parked)."""
        return await self._claim(limit, lease, token, owner, max_attempts, None, carried)

    async def _claim(
        self,
        limit: int,
        lease: float,
        token: uuid.UUID,
        owner: str,
        max_attempts: int,
        policy: ClaimPolicy,
        carried: Claim[T] | None = None,
    ) -> tuple[Claim[T] | None, Settled | None]:
        params: dict[str, Any] = {
            "lease": lease,
            "token": token,
            "relay_id": owner,
            "limit": limit,
            "max_attempts": max_attempts,  # the crash-loop guard
            "commit": self._commit,
        }
        self.lease = lease  # (the bound of this claim's and its settles' round trips)
        statement = self.sql.claim_batch
        if carried is not None:  # (the plain claim's; never ordered: carries_settles)
            keep = self.retention == "keep"
            statement = self.sql.claim_settling_keep if keep else self.sql.claim_settling_delete
            params.update(settle_lo=carried.ids[0], settle_hi=carried.ids[-1],
                          settle_token=carried.token)  # fmt: skip
        elif isinstance(policy, HeadsOnly):
            assert isinstance(self.sql, OrderedStatements), "a HeadsOnly claim needs ordered=True"
            statement = self.sql.ordered_claim
            params.update(
                scan=SCAN_FACTOR * limit,
                margin=policy.margin,
                draining=sorted(policy.draining),
                block=policy.block,
            )
        try:
            conn = await self._claim_connection()
            if conn is None:
                return None, None  # (parked: nothing due, nothing settled)
            records = await self._fetch(conn, statement, params)
        except pg_errors.UndefinedTable:
            database = self._claim_conn.info.dbname if self._claim_conn else None
            raise SchemaError(
                f"outbox table {self.table!r} not found in database"
                f" {database!r}: run `outboxkit migrate --dsn ... --table {self.table}`"
            ) from None
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        settled: Settled | None = None
        if carried is not None:
            mine = [r for r in records if r[0] is None]  # (the settle's row: id NULL)
            settled = _carried_settle(carried, mine[0] if mine else None)
            if mine:
                records = [r for r in records if r[0] is not None]
        if not records:
            return None, settled
        self.claimed_some()
        make = self.make_item
        dead: list[tuple[T, str, str]] | None = None
        if records[-1][-1] is not None or any(r[-1] is not None for r in records):
            # Rows the (ordered) claim dead-lettered, their error in the last column; rows
            # the claim left to dead-letter, their last column empty (postgres.py
            # DEAD_LETTER): dead-lettered now. Both reported.
            rows = [r for r in records if r[-1]]
            if to_kill := [r[0] for r in records if r[-1] == ""]:
                rows += await self._dead_letter(conn, to_kill, params)
            dead = [(make(*r[1:-1]), _dead_class(r[-1]), r[-1]) for r in rows] or None
            records = [r for r in records if r[-1] is None]
            if not records and dead is None:  # (taken since by a relay with a higher max)
                return None, settled
        # The claim returns rows in primary-key order in practice, not by contract:
        # sorting an already sorted list costs one pass.
        records.sort(key=_ROW_ID)
        # Positional construction: the claim returns the item's fields in order.
        claim = Claim(token, [r[0] for r in records], [make(*r[1:-1]) for r in records], dead)
        return claim, settled

    async def _fetch(
        self, conn: psycopg.AsyncConnection[Any], statement: str, params: dict[str, Any]
    ) -> list[Any]:
        """``statement``'s rows on the claim connection ``conn`` (or the LISTEN session's,
        while the claim connection opens)."""
        if conn is self._listen_conn:  # (unparking: the claim connection opens meanwhile)
            return await self._on_listen(  # type: ignore[no-any-return]
                "claim", lambda c: fetch_rows(c.cursor(binary=True), statement, params)
            )
        cur = self._cursor(conn, "claim")
        return await self.within(conn, "claim", fetch_rows(cur, statement, params))

    async def _dead_letter(
        self, conn: psycopg.AsyncConnection[Any], ids: list[int], params: dict[str, Any]
    ) -> list[Any]:
        """Dead-letter the crash-looping or oversized rows ``ids`` a claim left
        (postgres.py DEAD_LETTER); the rows it changed. A failure changes nothing: the next
        claim finds them again."""
        try:
            return await self._fetch(conn, self.sql.dead_letter, params | {"dead": ids})
        except (psycopg.Error, StoreError) as exc:
            why = await self._translate(exc) if isinstance(exc, psycopg.Error) else exc
            log.warning("could not dead-letter %d events (the next claim retries): %s",
                        len(ids), why)  # fmt: skip
            return []

    # -- settle -------------------------------------------------------------------------

    async def settle(self, claim: Claim[T], decisions: Sequence[Decision]) -> Settled:
        ids = claim.ids
        token = claim.token
        commit = self._commit
        keep = self.retention == "keep"
        if decisions.count(DONE) == len(ids):  # (identity first: the shared DONE value)
            if self.ordered:  # (its fenced settles take the ids)
                stmt = self._published_keep if keep else self._published_delete
                params: tuple[Any, ...] = (ids, token, commit)
            else:  # ids sorted (claim): by token and range
                stmt = self.sql.settle_claim_keep if keep else self.sql.settle_claim_delete
                params = (ids[0], ids[-1], token, commit)
            whole = await self._run(stmt, params, ids)
            return Settled(whole, len(ids) - len(whole))
        groups = group_decisions(claim, decisions)
        published, fail_ids = groups.done, groups.failed
        fail_status = [Status.FAILED if dead else Status.PENDING for dead in groups.dead]
        fail_delay, fail_error = groups.delays, groups.errors
        fail_refund = [int(refund) for refund in groups.refund]
        done: list[int] = []
        if published:
            already = self._partial.get(token)
            if already is None:
                stmt = self._published_keep if keep else self._published_delete
                already = await self._run(stmt, (published, token, commit), published)
                self._partial[token] = already
            done.extend(already)
        params = (fail_ids, fail_status, fail_delay, fail_error, fail_refund, token, commit)
        try:
            done.extend(await self._run(self._failures, params, fail_ids))
        except (StoreUnavailable, StoreTimeout, StoreDenied):
            raise  # retried: the published part is not settled twice
        except StoreError:
            self._partial.pop(token, None)
            raise
        self._partial.pop(token, None)
        return Settled(done, len(ids) - len(done))

    async def _run(self, stmt: str, params: Sequence[Any], ids: list[int]) -> list[int]:
        """Run one fenced settle statement of ``ids``; the ids it changed.

        ``ids`` itself when all of them (told by the row count), fewer when another claim
        took some (the statement returns the ids it changed).
        """
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:  # one settle at a time uses the cursor
                cur = self._cursor(conn, "settle")
                changed = await self.within(conn, "settle", _changed(cur, stmt, params, ids))
            return changed
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc

    async def extend_leases(self, claim: Claim[T], lease: float) -> int:
        self.lease = lease
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:
                cur = await self.within(
                    conn,
                    "lease heartbeat",
                    conn.execute(self._extend, (lease, claim.ids, claim.token, self._commit)),
                )
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        return cur.rowcount

    async def release(self, claim: Claim[T]) -> int:
        self._partial.pop(claim.token, None)
        try:
            conn = await self._connection("settle")
            cur = await self.within(
                conn, "release", conn.execute(self._release, (claim.ids, claim.token, self._commit))
            )
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        return cur.rowcount

    async def hasten(self, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:
                cur = await self.within(
                    conn,
                    "settle",
                    conn.execute(self.sql.hasten_handed_back, (list(ids), self._commit)),
                )
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        return cur.rowcount

    # -- connections ----------------------------------------------------------------------

    def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        super()._configure(conn)
        conn.adapters.register_loader("uuid", UuidBinaryLoader)
        conn.adapters.register_loader("json", JsonLoader)

    async def _prepare_listen(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Its claims return what they do on a claim connection: the same loaders, UTC."""
        self._configure(conn)
        await conn.execute(SESSION_UTC)
        return True

    def _cursor(
        self, conn: psycopg.AsyncConnection[Any], role: Literal["claim", "settle"]
    ) -> psycopg.AsyncCursor[Any]:
        """The connection's cursor for claims (or settles), kept across statements.

        A cursor per statement rebuilt psycopg's adaptation state every time: with a
        few events per claim that was a tenth of the relay's CPU. Binary results:
        payloads arrive as raw bytes instead of hex text to decode.
        """
        cur = self._cursors.get(role)
        if cur is None or cur.connection is not conn:
            cur = self._cursors[role] = conn.cursor(binary=True)
        return cur

    async def _connection(self, role: Literal["claim", "settle"]) -> psycopg.AsyncConnection[Any]:
        """The base's claim or settle connection, its session in UTC: psycopg's timestamp
        loader then skips the zone conversion (0.86 -> 0.33 us a timestamp, two a row).
        PgBouncer tracks TimeZone per client, so a pooled session is set again for us."""
        known = self._claim_conn if role == "claim" else self._settle_conn
        conn = await super()._connection(role)
        if conn is not known:
            try:
                await self.within(conn, "connection's set-up", conn.execute(SESSION_UTC))
            except BaseException:
                await conn.close()
                raise
        return conn

    async def close(self) -> None:
        await super().close()
        self._partial.clear()


def _carried_settle(carried: Claim[Any], row: Any) -> Settled:
    """What the claim's carried settle changed, from its row (None when it changed nothing:
    the fence dropped every item): every id when the count says so, else those it lists."""
    ids = carried.ids
    if row is None:
        return Settled([], len(ids))
    count = int(row[10])
    if count == len(ids):
        return Settled(ids)
    done = [int(i) for i in row[2].split(",")]
    return Settled(done, len(ids) - len(done))


async def _changed(
    cur: psycopg.AsyncCursor[Any], statement: str, params: Sequence[Any], ids: list[int]
) -> list[int]:
    """The ids a fenced settle statement changed: ``ids`` itself when all of them (told by
    the row count), fewer when another claim took some (the statement returns those)."""
    await cur.execute(statement, params)
    if cur.rowcount == len(ids):
        return ids
    return [row[0] for row in await cur.fetchall()]  # (RETURNING id)
