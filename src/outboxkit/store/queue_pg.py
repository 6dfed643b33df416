"""PostgreSQL's implementation of the queue store (outboxkit.queue.store.QueueStore).

It runs the named statements of store/postgres.py (and, for the ordered claim policy,
store/ordered_sql.py) on two autocommit connections, one for claims and one for
settles, and turns psycopg's errors into the store interface's: a lost connection
(errors.connection_lost, the one rule), a cancelled statement, a refused write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, TypeVar

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg.pq import Format
from psycopg.types.json import set_json_loads

from outboxkit._backoff import Backoff
from outboxkit._text import first_line
from outboxkit.errors import (
    ConfigurationError,
    SchemaError,
    connection_lost,
    relay_schema_outdated,
    table_missing,
    write_denied,
)
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
    Verdict,
)
from outboxkit.store._connection import PoolerMode, aconnect, known_pooling
from outboxkit.store.ordered_sql import OrderedStatements
from outboxkit.store.postgres import SESSION_UTC, Statements, Status

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


#: The ordered claim looks at this many times the batch size of pending keyed rows.
SCAN_FACTOR = 4

_ROW_ID = operator.itemgetter(0)


def _dead_class(error: str) -> str:
    """The kind of a dead letter the claim made, from the error it stored (store/postgres.py)."""
    if error.startswith("relay: claimed"):
        return "crash_loop"
    if error.startswith("relay: tried"):
        return "max_attempts"
    return "oversized"


class PgQueueStore(Generic[T]):
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
        self.dsn = dsn
        self.pooler = pooler
        self.direct_dsn = direct_dsn
        self.table = table
        self.make_item = make_item
        self.retention: Retention = retention
        self.ordered = ordered
        self.name = name
        self._commit: str | None = None if synchronous_commit else "off"
        self.sql: Statements = OrderedStatements(table) if ordered else Statements(table)
        sq = self.sql
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
        self._claim_conn: psycopg.AsyncConnection[Any] | None = None
        self._settle_conn: psycopg.AsyncConnection[Any] | None = None
        self._gate_conn: psycopg.AsyncConnection[Any] | None = None
        self._direct_conn: psycopg.AsyncConnection[Any] | None = None
        self._told_pooled = False
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
        params: dict[str, Any] = {
            "lease": lease,
            "token": token,
            "relay_id": owner,
            "limit": limit,
            "max_attempts": max_attempts,  # the crash-loop guard
            "commit": self._commit,
        }
        statement = self.sql.claim_batch
        if isinstance(policy, HeadsOnly):
            assert isinstance(self.sql, OrderedStatements), "a HeadsOnly claim needs ordered=True"
            statement = self.sql.ordered_claim
            params.update(
                scan=SCAN_FACTOR * limit,
                margin=policy.margin,
                draining=sorted(policy.draining),
                block=policy.block,
            )
        try:
            conn = await self._connection("claim")
            cur = self._cursor(conn, "claim")
            await cur.execute(statement, params)
            records = await cur.fetchall()
        except pg_errors.UndefinedTable:
            database = self._claim_conn.info.dbname if self._claim_conn else None
            raise SchemaError(
                f"outbox table {self.table!r} not found in database"
                f" {database!r}: run `outboxkit migrate --dsn ... --table {self.table}`"
            ) from None
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        if not records:
            return None
        make = self.make_item
        dead: list[tuple[T, str, str]] | None = None
        if records[-1][-1] is not None or any(r[-1] is not None for r in records):
            # Rows the claim dead-lettered (their error in the last column): reported.
            dead = [(make(*r[1:-1]), _dead_class(r[-1]), r[-1]) for r in records if r[-1]]
            records = [r for r in records if r[-1] is None]
        # The claim returns rows in primary-key order in practice, not by contract:
        # sorting an already sorted list costs one pass.
        records.sort(key=_ROW_ID)
        # Positional construction: the claim returns the item's fields in order.
        return Claim(token, [r[0] for r in records], [make(*r[1:-1]) for r in records], dead)

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
        published: list[int] = []
        fail_ids: list[int] = []
        fail_status: list[int] = []
        fail_delay: list[float] = []
        fail_error: list[str] = []
        fail_refund: list[int] = []
        for item_id, decision in zip(ids, decisions, strict=True):
            verdict = decision.verdict
            if verdict is Verdict.DONE:
                published.append(item_id)
                continue
            fail_ids.append(item_id)
            fail_error.append(decision.error or "unknown error")
            fail_delay.append(decision.delay)
            fail_status.append(Status.FAILED if verdict is Verdict.DEAD else Status.PENDING)
            fail_refund.append(1 if verdict is Verdict.HAND_BACK else 0)
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
                await cur.execute(stmt, params)
                if cur.rowcount == len(ids):
                    return ids
                return [row[0] for row in await cur.fetchall()]  # (RETURNING id)
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc

    async def extend_leases(self, claim: Claim[T], lease: float) -> int:
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:
                cur = await conn.execute(
                    self._extend, (lease, claim.ids, claim.token, self._commit)
                )
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        return cur.rowcount

    async def release(self, claim: Claim[T]) -> int:
        self._partial.pop(claim.token, None)
        try:
            conn = await self._connection("settle")
            cur = await conn.execute(self._release, (claim.ids, claim.token, self._commit))
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        return cur.rowcount

    async def hasten(self, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:
                cur = await conn.execute(self.sql.hasten_handed_back, (list(ids), self._commit))
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        return cur.rowcount

    # -- the wake-up gate (store/postgres.py WAKE_GATE) ---------------------------------

    @property
    def session_state(self) -> bool:
        """Whether the claim connection keeps session state (not behind a transaction pooler;
        unknown before the first connection: assumed)."""
        pooling = known_pooling(self.dsn, self.pooler)
        return pooling is None or pooling.session_state

    def _tell_pooled(self) -> None:
        if not self._told_pooled:
            self._told_pooled = True
            log.warning(
                "the relay's database connection goes through a transaction pooler: no LISTEN"
                " and no wake-up gate (they need a session), so events are found by the poll"
                " (--poll-interval); give --direct-dsn (PostgreSQL itself, not the pooler)"
                " for wake-ups within milliseconds"
            )

    @property
    def gate_closed(self) -> bool:
        gate = self._gate_conn
        owner = self._claim_conn if self.direct_dsn is None else self._direct_conn
        if gate is not None and (gate is not owner or gate.closed):
            self._gate_conn = None  # its connection was replaced: the lock went with it
        return self._gate_conn is not None

    async def close_gate(self) -> bool:
        """Take the wake-up gate's lock: from now on writers notify. False if held elsewhere.

        The lock is a session's: it is taken on ``direct_dsn`` when given, and never
        through a transaction pooler (it would stay on whichever server connection ran it).
        """
        try:
            if self.direct_dsn is not None:
                conn = await self._direct()
            else:
                conn = await self._connection("claim")
                if not self.session_state:
                    self._tell_pooled()
                    return False
            cur = await conn.execute(self.sql.try_wake_lock)
            row = await cur.fetchone()
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        if row is None or not row[0]:
            return False
        self._gate_conn = conn
        return True

    async def open_gate(self) -> None:
        """Release the wake-up gate's lock: writers stop notifying while the relay works."""
        conn, self._gate_conn = self._gate_conn, None
        owner = self._claim_conn if self.direct_dsn is None else self._direct_conn
        if conn is None or conn.closed or conn is not owner:
            return
        try:
            await conn.execute(self.sql.wake_unlock)
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc

    @property
    def can_listen(self) -> bool:
        return self.direct_dsn is not None or self.session_state

    async def listen(self, wake: Callable[[], None]) -> None:
        """Wake the claim loop on NOTIFY. Polling still runs: notifications are not durable.

        LISTEN needs a session: it runs on ``direct_dsn`` when given, and returns at once
        (the poll remains) when its connection turns out to go through a transaction pooler.
        """
        backoff = Backoff(base=0.5, cap=10.0)
        channel = sql.Identifier(self.sql.channel)
        dsn = self.direct_dsn or self.dsn
        while True:
            try:
                async with await aconnect(
                    dsn, application_name=f"{self.name}:listen", pooler=self._pooler_of(dsn)
                ) as conn:
                    if not self._listenable(dsn):
                        return
                    await conn.execute(sql.SQL("LISTEN {}").format(channel))
                    backoff.reset()
                    wake()  # anything committed while we were not listening
                    async for _notify in conn.notifies():
                        wake()
            except psycopg.OperationalError as exc:
                delay = backoff.next_delay()
                log.debug("LISTEN connection lost (%s); retrying in %.2fs", first_line(exc), delay)
                await asyncio.sleep(delay)

    # -- connections ----------------------------------------------------------------------

    def _pooler_of(self, dsn: str) -> PoolerMode | None:
        """The ``pooler`` override applies to the relay's DSN, not to its direct one."""
        return self.pooler if dsn is self.dsn else None

    def _listenable(self, dsn: str) -> bool:
        pooling = known_pooling(dsn, self._pooler_of(dsn))
        if pooling is None or pooling.session_state:
            return True
        if dsn is self.dsn:
            self._tell_pooled()
            return False
        raise _direct_pooled()

    async def _direct(self) -> psycopg.AsyncConnection[Any]:
        """The connection to ``direct_dsn`` that holds the wake-up gate's lock."""
        conn = self._direct_conn
        if conn is not None and not conn.closed:
            return conn
        assert self.direct_dsn is not None
        conn = await aconnect(self.direct_dsn, application_name=f"{self.name}:gate")
        pooling = known_pooling(self.direct_dsn)
        if pooling is not None and not pooling.session_state:
            await conn.close()
            raise _direct_pooled()
        self._direct_conn = conn
        return conn

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
        conn = self._claim_conn if role == "claim" else self._settle_conn
        if conn is not None and not conn.closed:
            return conn
        conn = await aconnect(self.dsn, application_name=f"{self.name}:{role}", pooler=self.pooler)
        set_json_loads(orjson.loads, conn)
        conn.adapters.register_loader("uuid", UuidBinaryLoader)
        try:
            await conn.execute(SESSION_UTC)
        except BaseException:
            await conn.close()
            raise
        if role == "claim":
            self._claim_conn = conn
        else:
            self._settle_conn = conn
        return conn

    async def _translate(self, exc: psycopg.Error) -> StoreError:
        """``exc`` as the store interface's error; broken connections are dropped."""
        if write_denied(exc):
            return StoreDenied(first_line(exc, with_type=True), cause=exc)
        if connection_lost(exc):
            for conn in (self._claim_conn, self._settle_conn, self._direct_conn):
                if conn is not None and conn.broken:
                    with contextlib.suppress(Exception):
                        await conn.close()
            return StoreUnavailable(first_line(exc, with_type=True), cause=exc)
        if isinstance(exc, psycopg.OperationalError):
            return StoreTimeout(first_line(exc, with_type=True), cause=exc)
        return StoreError(first_line(exc, with_type=True), cause=exc)

    async def close(self) -> None:
        for conn in (self._claim_conn, self._settle_conn, self._direct_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._claim_conn = self._settle_conn = self._gate_conn = self._direct_conn = None
        self._partial.clear()


def _direct_pooled() -> ConfigurationError:
    return ConfigurationError(
        "--direct-dsn goes through a transaction pooler too: it must reach PostgreSQL itself"
        " (the LISTEN connection and the session locks need a session of their own)"
    )
