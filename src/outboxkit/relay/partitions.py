"""Partition leases: live ordered relays divide an outbox's P partitions among themselves.

Every ``lease / 3`` (at most 2 s) a relay renews its row in ``<table>_relays`` and reads the live
ones. The assignment follows from that list alone (sorted ids, partition p to member
``p % n``), so every relay computes the same one without talking to the others. A
relay takes the partitions assigned to it once they are free or their lease expired,
renews the ones it holds, and gives back the ones assigned elsewhere only after its
batches claimed from them have settled (the claim loop says when: :meth:`release_soon`).
A relay SIGKILLed stops renewing: its membership and its leases expire within one
lease, and the survivors take its partitions at their next heartbeat (within 2 x lease).

The heartbeat's statements are single autocommit statements, fine through a transaction
pooler; the relay-id lock (a session advisory lock held for the relay's life) is not: it
is taken on the direct DSN when given, skipped for a generated relay id (unique by
construction), and an explicit ``--relay-id`` behind a transaction pooler without a direct
DSN is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from outboxkit._backoff import Backoff
from outboxkit._text import first_line
from outboxkit.backends.postgres._connection import PoolerMode, aconnect, known_pooling
from outboxkit.backends.postgres.ordered_sql import OrderedStatements
from outboxkit.errors import ConfigurationError, SchemaError

log = logging.getLogger("outboxkit.relay.partitions")

#: Heartbeats come every lease/3, at most this many seconds apart: a joining relay is
#: seen, and gets its share, within a few seconds even with a long lease.
MAX_INTERVAL = 2.0


def assignment(members: Iterable[str], me: str, partitions: int) -> frozenset[int]:
    """The partitions ``me`` should hold: partition p goes to the (p mod n)-th live relay."""
    ordered = sorted(set(members) | {me})
    index, n = ordered.index(me), len(ordered)
    return frozenset(p for p in range(partitions) if p % n == index)


class PartitionLeases:
    """One relay's view of its partitions, kept current by :meth:`run` (a side task).

    ``owned``: the partitions it held at its last heartbeat; ``draining``: held but
    assigned to another relay, with the monotonic time that started (the claim loop
    claims none of them from then on). The claim itself checks the lease in the
    database, so a relay whose heartbeat fails stops claiming keyed rows by itself
    once its leases run low.
    """

    def __init__(
        self,
        dsn: str,
        stmts: OrderedStatements,
        relay_id: str,
        lease: float,
        *,
        pooler: PoolerMode | None = None,
        direct_dsn: str | None = None,
        unique_id: bool = False,
    ) -> None:
        self.dsn = dsn
        self.pooler = pooler
        self.direct_dsn = direct_dsn
        self.unique_id = unique_id
        self.stmts = stmts
        self.relay_id = relay_id
        self.lease = lease
        self.interval = min(lease / 3, MAX_INTERVAL)
        self.partitions = 0  # P, read at the first heartbeat
        self.members: tuple[str, ...] = ()
        self.owned: frozenset[int] = frozenset()
        self.desired: frozenset[int] = frozenset()
        self.draining: dict[int, float] = {}
        self._releasable: set[int] = set()
        self._valid_until = 0.0  # monotonic: the held leases certainly last until then
        self._wake = asyncio.Event()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock_conn: psycopg.AsyncConnection[Any] | None = None  # on direct_dsn
        self.beats = 0
        #: Counts heartbeats that found a held partition taken: a batch claimed before one
        #: may hold rows of it, so it cannot lean on the renewals since (ordered.py).
        self.losses = 0

    def owned_count(self) -> int:
        """Partitions held now (0 once the last renewal's lease has run out)."""
        return len(self.owned) if time.monotonic() < self._valid_until else 0

    def safe_until(self) -> float:
        """Monotonic time before which every partition renewed at the last heartbeat is
        certainly still held (its lease counted from before the renewal was sent), less
        a tenth of the lease for what is already on the wire."""
        return self._valid_until - 0.1 * self.lease

    def release_soon(self, partitions: Iterable[int]) -> None:
        """The claim loop's word: nothing claimed from these is in flight any more."""
        ready = {p for p in partitions if p in self.draining}
        if ready - self._releasable:
            self._releasable |= ready
            self._wake.set()

    async def check_schema(self) -> None:
        """Raise SchemaError unless ``migrate --ordered`` ran on this outbox."""
        conn = await self._connection()
        try:
            cur = await conn.execute(self.stmts.partition_count)
            row = await cur.fetchone()
        except (pg_errors.UndefinedTable, pg_errors.UndefinedColumn):
            raise _not_ordered(self.stmts.table) from None
        if not row or not row[0]:
            raise _not_ordered(self.stmts.table)

    async def run(self) -> None:
        """Heartbeat until cancelled; then give every partition back and leave."""
        backoff = Backoff(base=0.2, cap=self.interval)
        try:
            while True:
                self._wake.clear()
                try:
                    await self.beat()
                    backoff.reset()
                    delay = self.interval
                except SchemaError:
                    raise
                except self.errors as exc:
                    delay = backoff.next_delay()
                    log.warning(
                        "partition heartbeat failed (%s): retrying in %.1fs; without a renewal"
                        " this relay stops claiming keyed events when its leases run low",
                        first_line(exc),
                        delay,
                    )
                    await self._drop_connection()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
        finally:
            await asyncio.shield(self._leave())

    async def beat(self) -> None:
        """One heartbeat: membership, assignment, releases, then take and renew."""
        started = time.monotonic()
        if not self.partitions:
            await self.check_schema()
            self.partitions = await self._partition_count()
        members = await self._heartbeat()
        if members != self.members:
            log.info("ordered relays alive: %d (%s)", len(members), ", ".join(members))
            self.members = members
        self.desired = assignment(members, self.relay_id, self.partitions)
        now = time.monotonic()
        for p in self.owned - self.desired:
            if p not in self.draining:
                self.draining[p] = now
                self._releasable.discard(p)
        for p in self.desired:
            self.draining.pop(p, None)
        release = sorted(self._releasable & set(self.draining))
        self._releasable.clear()
        if release:
            await self._release(release)
            for p in release:
                del self.draining[p]
            log.info("released %d partition(s) to other relays: %s", len(release), release)
        wanted = sorted(self.desired | set(self.draining))
        owned = await self._acquire(wanted)
        gained, lost = owned - self.owned, (self.owned - owned) - set(release)
        if lost:  # before the renewal counts: nothing awaited in between
            self.losses += 1
        self._valid_until = started + self.lease
        if gained:
            log.info("took %d partition(s) (now %d): %s", len(gained), len(owned), sorted(gained))
        if lost:
            log.warning("lost %d partition(s) to another relay: %s", len(lost), sorted(lost))
        self.owned = owned
        for p in list(self.draining):
            if p not in owned:
                del self.draining[p]
        self.beats += 1

    async def _leave(self) -> None:
        """Give every partition back and leave the membership (best effort, bounded)."""
        owned, self.owned = self.owned, frozenset()
        self._valid_until = 0.0
        if self.beats == 0:
            return
        # A fresh connection: the heartbeat's may have been cancelled mid-statement.
        await self._drop_connection()
        failures: tuple[type[Exception], ...] = (*self.errors, TimeoutError, ConfigurationError)
        try:
            async with asyncio.timeout(3.0):
                await self._give_back(sorted(owned))
            if owned:
                log.info("gave back %d partition(s) at shutdown", len(owned))
        except failures as exc:
            log.warning("could not give back partitions at shutdown (%s): they expire", exc)
        finally:
            await self._drop_connection()
            lock, self._lock_conn = self._lock_conn, None
            if lock is not None:
                with contextlib.suppress(Exception):
                    await lock.close()

    # -- the lease tables' statements (a MariaDB relay overrides these: relay/partitions_mariadb.py)

    #: What a failed heartbeat statement raises (retried with backoff).
    errors: tuple[type[Exception], ...] = (psycopg.Error,)

    async def _partition_count(self) -> int:
        cur = await (await self._connection()).execute(self.stmts.partition_count)
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def _heartbeat(self) -> tuple[str, ...]:
        params = {"relay_id": self.relay_id, "lease": self.lease}
        cur = await (await self._connection()).execute(self.stmts.relay_heartbeat, params)
        return tuple(r[0] for r in await cur.fetchall())

    async def _release(self, parts: list[int]) -> None:
        params = {"relay_id": self.relay_id, "parts": parts}
        await (await self._connection()).execute(self.stmts.release_partitions, params)

    async def _acquire(self, wanted: list[int]) -> frozenset[int]:
        params = {"relay_id": self.relay_id, "lease": self.lease, "wanted": wanted}
        cur = await (await self._connection()).execute(self.stmts.acquire_partitions, params)
        return frozenset(int(r[0]) for r in await cur.fetchall())

    async def _give_back(self, parts: list[int]) -> None:
        """Release ``parts`` and leave the membership (at shutdown)."""
        conn = await self._connection()
        params = {"relay_id": self.relay_id, "parts": parts}
        await conn.execute(self.stmts.release_partitions, params)
        await conn.execute(self.stmts.leave, params)

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            conn = await aconnect(
                self.dsn, application_name="outboxkit-relay:partitions", pooler=self.pooler
            )
            try:
                await self._hold_id_lock(conn)
            except BaseException:
                await conn.close()
                raise
            self._conn = conn
        return self._conn

    async def _hold_id_lock(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Hold the relay-id lock (a session's) for as long as this relay runs.

        On ``conn`` itself when it keeps its session; on a connection to ``direct_dsn``
        when given; behind a transaction pooler without one, a generated id needs no lock
        and an explicit one is refused (the lock would stay on a pooled server connection).
        """
        if self.direct_dsn is not None:
            if self._lock_conn is not None and not self._lock_conn.closed:
                return
            lock = await aconnect(self.direct_dsn, application_name="outboxkit-relay:relay-id")
            pooling = known_pooling(self.direct_dsn)
            if pooling is not None and not pooling.session_state:
                await lock.close()
                raise ConfigurationError(
                    "--direct-dsn goes through a transaction pooler too: it must reach"
                    " PostgreSQL itself (ordered mode's relay-id lock needs a session)"
                )
            try:
                await self._try_id_lock(lock)
            except BaseException:
                await lock.close()
                raise
            self._lock_conn = lock
            return
        pooling = known_pooling(self.dsn, self.pooler)
        if pooling is not None and not pooling.session_state:
            if self.unique_id:
                return  # host-pid-random: no other process has it
            raise ConfigurationError(
                f"ordered relay {self.relay_id!r}: an explicit --relay-id is guarded by a"
                " session advisory lock, which a transaction pooler cannot hold; give"
                " --direct-dsn (PostgreSQL itself) for the lock, or leave --relay-id out"
                " (the default, host-pid-random, is unique)"
            )
        await self._try_id_lock(conn)

    async def _try_id_lock(self, conn: psycopg.AsyncConnection[Any]) -> None:
        cur = await conn.execute(self.stmts.relay_id_lock, {"relay_id": self.relay_id})
        row = await cur.fetchone()
        if not row or not row[0]:
            raise ConfigurationError(
                f"another ordered relay runs with relay id {self.relay_id!r} on"
                f" {self.stmts.table!r}: two processes with one id would share its"
                " partitions and publish the same keys side by side; give each relay"
                " its own --relay-id (the default, host-pid-random, is unique)"
            )

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


def _not_ordered(table: str) -> SchemaError:
    return SchemaError(
        f"outbox table {table!r} is not set up for ordered mode: run"
        f" `outboxkit migrate --ordered --table {table}` (adds the partition column and"
        " the lease tables), or start the relay without --ordered"
    )
