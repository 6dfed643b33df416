"""Partition leases: live ordered relays divide an outbox's P partitions among themselves.

Every ``lease / 3`` (at most 2 s) a relay renews its row in ``<table>_relays`` and reads the live
ones. The assignment follows from that list alone (sorted ids, partition p to member
``p % n``), so every relay computes the same one without talking to the others. A
relay takes the partitions assigned to it once they are free or their lease expired,
renews the ones it holds, and gives back the ones assigned elsewhere only after its
batches claimed from them have settled (the claim loop says when: :meth:`release_soon`).
A relay SIGKILLed stops renewing: its membership and its leases expire within one
lease, and the survivors take its partitions at their next heartbeat (within 2 x lease).

The algorithm is here, once; the lease tables' statements are a port (:class:`LeaseTable`)
each backend implements with its own SQL (backends/postgres/partition_leases.py,
backends/mariadb/partition_leases.py), handed out by ``Backend.partition_leases``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Protocol

from outboxkit._backoff import Backoff
from outboxkit._text import first_line
from outboxkit.errors import ConfigurationError, SchemaError

__all__ = ["MAX_INTERVAL", "LeaseTable", "PartitionLeases", "assignment", "not_ordered"]

log = logging.getLogger("outboxkit.relay.partition_leases")

#: Heartbeats come every lease/3, at most this many seconds apart: a joining relay is
#: seen, and gets its share, within a few seconds even with a long lease.
MAX_INTERVAL = 2.0


def assignment(members: Iterable[str], me: str, partitions: int) -> frozenset[int]:
    """The partitions ``me`` should hold: partition p goes to the (p mod n)-th live relay."""
    ordered = sorted(set(members) | {me})
    index, n = ordered.index(me), len(ordered)
    return frozenset(p for p in range(partitions) if p % n == index)


def not_ordered(table: str) -> SchemaError:
    return SchemaError(
        f"outbox table {table!r} is not set up for ordered mode: run"
        f" `outboxkit migrate --ordered --table {table}` (adds the partition column and"
        " the lease tables), or start the relay without --ordered"
    )


def duplicate_relay_id(relay_id: str, table: str) -> ConfigurationError:
    return ConfigurationError(
        f"another ordered relay runs with relay id {relay_id!r} on {table!r}: two processes"
        " with one id would share its partitions and publish the same keys side by side;"
        " give each relay its own --relay-id (the default, host-pid-random, is unique)"
    )


class LeaseTable(Protocol):
    """One relay's statements on an outbox's lease tables (``<table>_partitions``,
    ``<table>_relays``), each an autocommit statement on the heartbeat's connection, which
    also holds the relay-id guard for the relay's life."""

    #: What a failed statement raises (the heartbeat retries it with backoff).
    errors: tuple[type[Exception], ...]

    async def check_schema(self) -> None:
        """Raise :func:`not_ordered`'s SchemaError unless ``migrate --ordered`` ran."""
        ...

    async def partition_count(self) -> int: ...

    async def heartbeat(self) -> tuple[str, ...]:
        """Renew this relay's membership; the live relays' ids, sorted."""
        ...

    async def release(self, parts: list[int]) -> None: ...

    async def acquire(self, wanted: list[int]) -> frozenset[int]:
        """Take the free or expired ones of ``wanted`` and renew the held ones; what it holds."""
        ...

    async def give_back(self, parts: list[int]) -> None:
        """Release ``parts`` and leave the membership (at shutdown, on a fresh connection)."""
        ...

    async def drop_connection(self) -> None: ...

    async def close(self) -> None:
        """Drop every connection, the relay-id guard's too."""
        ...


class PartitionLeases:
    """One relay's view of its partitions, kept current by :meth:`run` (a side task).

    ``owned``: the partitions it held at its last heartbeat; ``draining``: held but
    assigned to another relay, with the monotonic time that started (the claim loop
    claims none of them from then on). The claim itself checks the lease in the
    database, so a relay whose heartbeat fails stops claiming keyed rows by itself
    once its leases run low.
    """

    def __init__(self, table: LeaseTable, relay_id: str, lease: float) -> None:
        self.table = table
        self.errors = table.errors
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
        await self.table.check_schema()

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
                    await self.table.drop_connection()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
        finally:
            await asyncio.shield(self._leave())

    async def beat(self) -> None:
        """One heartbeat: membership, assignment, releases, then take and renew."""
        started = time.monotonic()
        if not self.partitions:
            await self.table.check_schema()
            self.partitions = await self.table.partition_count()
        members = await self.table.heartbeat()
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
            await self.table.release(release)
            for p in release:
                del self.draining[p]
            log.info("released %d partition(s) to other relays: %s", len(release), release)
        wanted = sorted(self.desired | set(self.draining))
        owned = await self.table.acquire(wanted)
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
        await self.table.drop_connection()
        failures: tuple[type[Exception], ...] = (*self.errors, TimeoutError, ConfigurationError)
        try:
            async with asyncio.timeout(3.0):
                await self.table.give_back(sorted(owned))
            if owned:
                log.info("gave back %d partition(s) at shutdown", len(owned))
        except failures as exc:
            log.warning("could not give back partitions at shutdown (%s): they expire", exc)
        finally:
            await self.table.close()
