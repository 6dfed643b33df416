"""An in-memory queue store: PostgreSQL's claim and settle semantics with no database.

It implements :class:`outboxkit.queue.store.QueueStore` and passes the contract suite
PostgreSQL's store passes (tests/contract/), so the queue core runs on it in milliseconds,
and users' tests get a queue that behaves like the real one (issue 22's testing kit).

A :class:`MemoryQueue` is the table, shared by every claimer; a :class:`MemoryQueueStore`
is one claimer's view of it (PostgreSQL's store and its connections): several stores on
one queue are several relays on one table. Each operation runs without an ``await`` in
its middle, so it is atomic between asyncio tasks, as a statement is between sessions;
writes from other threads (``put``) take the queue's lock.

Every rule below is a statement of backends/postgres/postgres.py or
backends/postgres/ordered_sql.py, done in Python; where they differ, PostgreSQL is right and this
module is the bug. Time is the queue's ``clock`` (seconds, :class:`ManualClock` in tests that move
it by hand): ``available_at`` is the retry time while pending and the lease expiry while claimed.

Where it knowingly differs, because nothing here needs it: no size guard (items are
values, not rows a relay might fail to load), so a claim dead-letters only by the
crash-loop guard, and its dead items carry their whole value (PostgreSQL's carry no
payload); the wake-up gate is taken once, not counted like a session's advisory lock;
relay ids sort by code point, not by the database's collation.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from outboxkit.errors import ConfigurationError
from outboxkit.queue.store import (
    Attempted,
    Claim,
    ClaimPolicy,
    Decision,
    HeadsOnly,
    QueueStore,
    Settled,
    StoreInfo,
    StoreUnavailable,
    Verdict,
)

__all__ = ["ManualClock", "MemoryQueue", "MemoryQueueStore", "MemoryRow", "Status"]

#: What the queue holds per item (the event as written, a task, ...).
V = TypeVar("V")
#: What a claim hands the sink (built from the value and the attempt at claim time).
T = TypeVar("T", bound=Attempted)

Retention = Literal["delete", "keep"]
#: The start-up count of pending items stops here (PostgreSQL's store reads no further).
PENDING_CAP = 100_000
#: The ordered claim looks at this many times the batch size of due keyed items (as
#: PostgreSQL's ORDERED_CLAIM does: a bound, so a claim costs the same as there).
SCAN_FACTOR = 4

# The crash-loop guard's errors (backends/postgres/postgres.py _looped_error), word for word.
_NEVER_SETTLED = (
    "relay: claimed {attempts} times (max_attempts) and never settled: each relay that"
    " claimed it died or hung publishing it (a message that crashes or hangs the relay,"
    " an OOM?). Dead-lettered without publishing it again: inspect it with `outboxkit"
    " failed show`, then replay or discard it"
)
_TRIED_BEFORE = (
    "relay: tried {attempts} times already, as many as this relay's max_attempts"
    " ({max_attempts}): a relay with a higher max_attempts retried it before. Dead-lettered"
    " without publishing it again: give the relays one --max-attempts, then replay it"
)


def _rotate(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & 0xFFFFFFFF


def _hashtext(data: bytes) -> int:
    """PostgreSQL's ``hashtext`` (hash_bytes in src/common/hashfn.c, Jenkins' lookup3) as
    an unsigned 32-bit value: keys land in the partitions they land in there."""
    m = 0xFFFFFFFF
    a = b = c = (0x9E3779B9 + len(data) + 3923095) & m
    whole = len(data) - len(data) % 12
    for i in range(0, whole, 12):
        a = (a + int.from_bytes(data[i : i + 4], "little")) & m
        b = (b + int.from_bytes(data[i + 4 : i + 8], "little")) & m
        c = (c + int.from_bytes(data[i + 8 : i + 12], "little")) & m
        a = ((a - c) & m) ^ _rotate(c, 4)
        c = (c + b) & m
        b = ((b - a) & m) ^ _rotate(a, 6)
        a = (a + c) & m
        c = ((c - b) & m) ^ _rotate(b, 8)
        b = (b + a) & m
        a = ((a - c) & m) ^ _rotate(c, 16)
        c = (c + b) & m
        b = ((b - a) & m) ^ _rotate(a, 19)
        a = (a + c) & m
        c = ((c - b) & m) ^ _rotate(b, 4)
        b = (b + a) & m
    tail = data[whole:].ljust(12, b"\0")  # the last 11 bytes; c's low byte is the length's
    a = (a + int.from_bytes(tail[0:4], "little")) & m
    b = (b + int.from_bytes(tail[4:8], "little")) & m
    c = (c + (int.from_bytes(tail[8:12], "little") << 8)) & m
    c = ((c ^ b) - _rotate(b, 14)) & m
    a = ((a ^ c) - _rotate(c, 11)) & m
    b = ((b ^ a) - _rotate(a, 25)) & m
    c = ((c ^ b) - _rotate(b, 16)) & m
    a = ((a ^ c) - _rotate(c, 4)) & m
    b = ((b ^ a) - _rotate(a, 14)) & m
    c = ((c ^ b) - _rotate(b, 24)) & m
    return c


def _looped(row: MemoryRow[V], max_attempts: int) -> tuple[str, str]:
    """(error class, stored error) of an item the crash-loop guard dead-letters.

    A claim token left on the item: the claimer that took it last never settled it; none:
    a settle retried it up to a higher max_attempts than this claimer's. Its last real
    error is kept after the verdict.
    """
    if row.claim_token is not None:
        kind, error = "crash_loop", _NEVER_SETTLED.format(attempts=row.attempts)
    else:
        kind = "max_attempts"
        error = _TRIED_BEFORE.format(attempts=row.attempts, max_attempts=max_attempts)
    if row.last_error is not None:
        error += ". Last error: " + row.last_error[:1000]
    return kind, error


class Status(enum.IntEnum):
    """An item's state, as store.postgres.Status: claimed items stay PENDING (the lease
    lives in available_at)."""

    PENDING = 0
    PUBLISHED = 1
    FAILED = 2


class ManualClock:
    """A clock a test moves by hand: ``clock.advance(31)`` expires a 30-second lease."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go back: advance by a non-negative number")
        self.now += seconds

    def __repr__(self) -> str:
        return f"ManualClock(now={self.now})"


@dataclass(slots=True)
class MemoryRow(Generic[V]):
    """One item of the queue: the columns of the outbox table the queue uses."""

    id: int
    value: V
    key: str | None
    #: The key's partition in an ordered queue (None: keyless, or not ordered).
    partition: int | None
    available_at: float
    created_at: float
    status: Status = Status.PENDING
    attempts: int = 0
    claim_token: uuid.UUID | None = None
    claimed_by: str | None = None
    last_error: str | None = None
    published_at: float | None = None


@dataclass(slots=True)
class _PartitionLease:
    owner: str | None = None
    epoch: int = 0
    expires_at: float | None = None


@dataclass(slots=True)
class _Listener:
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)


class MemoryQueue(Generic[V]):
    """The table: items in id order, the wake-up gate, and (ordered) the partition leases.

    ``partitions``: the queue is ordered (``outboxkit migrate --ordered``): each key hashes
    into one of that many partitions, leased to claimers by :meth:`acquire_partitions`.
    ``notify``: writers wake listening claimers while one holds the gate (``Outbox(notify=)``).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        partitions: int | None = None,
        notify: bool = True,
    ) -> None:
        if partitions is not None and not 1 <= partitions <= 32767:
            raise ConfigurationError("partitions must be an integer from 1 to 32767")
        self.clock = clock
        self.partitions = partitions
        self.notify = notify
        #: Set it to make every store operation raise StoreUnavailable (an outage).
        self.unavailable = False
        self._rows: dict[int, MemoryRow[V]] = {}
        self._pending: dict[int, MemoryRow[V]] = {}
        self._next_id = 1
        self._leases = [_PartitionLease() for _ in range(partitions or 0)]
        self._relays: dict[str, float] = {}  # ordered mode's members: relay id -> expiry
        self._gate: object | None = None
        self._listeners: list[_Listener] = []
        # Taken by every operation: writers may run in other threads than the claimers.
        self.lock = threading.RLock()

    def __repr__(self) -> str:
        return f"MemoryQueue(items={len(self._rows)}, partitions={self.partitions})"

    # -- the write side --------------------------------------------------------------

    def put(self, value: V, *, key: str | None = None, delay: float = 0.0) -> int:
        """Append one item, due after ``delay`` seconds; its id (ids only grow)."""
        return self.put_many([value], key=key, delay=delay)[0]

    def put_many(
        self, values: Iterable[V], *, key: str | None = None, delay: float = 0.0
    ) -> list[int]:
        """Append items (one "transaction"), due after ``delay``; wakes listeners once."""
        if delay < 0:
            raise ValueError("delay must be non-negative")
        with self.lock:
            now = self.clock()
            ids = []
            for value in values:
                row = MemoryRow(
                    id=self._next_id,
                    value=value,
                    key=key,
                    partition=self.partition_of(key),
                    available_at=now + delay,
                    created_at=now,
                )
                self._next_id += 1
                self._rows[row.id] = self._pending[row.id] = row
                ids.append(row.id)
            # The write's NOTIFY: only while a claimer waits (the gate), none for items
            # not due yet (Outbox.put skips it for future-dated events).
            if ids and self.notify and delay <= 0 and self._gate is not None:
                self._wake_listeners()
        return ids

    # -- reading (tests, the testing kit) ----------------------------------------------

    def row(self, item_id: int) -> MemoryRow[V] | None:
        """The item with this id (a live row: read it, do not change it); None once deleted."""
        with self.lock:
            return self._rows.get(item_id)

    def rows(self) -> list[MemoryRow[V]]:
        """Every item in id order (published ones only under retention keep)."""
        with self.lock:
            return list(self._rows.values())

    def __len__(self) -> int:
        return len(self._rows)

    # -- ordered mode's partition leases (backends/postgres/ordered_sql.py)
    # -------------------------

    def partition_of(self, key: str | None) -> int | None:
        """The key's partition, the one PostgreSQL's ``partition`` column gives it
        (ordered_sql.py: ``mod(hashtext(key) + 2^31, P)``); None for a keyless item."""
        if key is None or self.partitions is None:
            return None
        return (_hashtext(key.encode()) ^ 0x80000000) % self.partitions

    def acquire_partitions(self, owner: str, wanted: Iterable[int], lease: float) -> list[int]:
        """Take the free or expired partitions of ``wanted``, renew ``owner``'s own
        (ACQUIRE_PARTITIONS); the partitions ``owner`` holds for ``lease`` seconds now."""
        with self.lock:
            now = self.clock()
            held = []
            for p in sorted(set(wanted)):
                if not 0 <= p < len(self._leases):
                    continue
                lease_row = self._leases[p]
                expired = lease_row.expires_at is None or lease_row.expires_at <= now
                if lease_row.owner == owner or lease_row.owner is None or expired:
                    if lease_row.owner != owner or expired:
                        lease_row.epoch += 1
                    lease_row.owner = owner
                    lease_row.expires_at = now + lease
                    held.append(p)
            return held

    def release_partitions(self, owner: str, parts: Iterable[int]) -> None:
        """Give up ``owner``'s leases on ``parts`` (RELEASE_PARTITIONS)."""
        with self.lock:
            for p in parts:
                if 0 <= p < len(self._leases) and self._leases[p].owner == owner:
                    self._leases[p].owner = self._leases[p].expires_at = None

    def relay_heartbeat(self, relay_id: str, lease: float) -> list[str]:
        """Renew ``relay_id``'s membership for ``lease`` seconds (RELAY_HEARTBEAT); every
        live member, itself included, sorted. Members dead for ten leases are forgotten."""
        with self.lock:
            now = self.clock()
            self._relays = {
                r: expires for r, expires in self._relays.items() if expires >= now - 10 * lease
            }
            live = {r for r, expires in self._relays.items() if expires > now} | {relay_id}
            self._relays[relay_id] = now + lease
            return sorted(live)

    def leave(self, relay_id: str) -> None:
        """Leave the membership at once (LEAVE): the others take its partitions over."""
        with self.lock:
            self._relays.pop(relay_id, None)

    def partition_owners(self) -> list[tuple[int, str | None, int, bool]]:
        """(partition, owner, epoch, held now) for every partition (PARTITION_OWNERS)."""
        with self.lock:
            now = self.clock()
            return [
                (
                    p,
                    lease.owner,
                    lease.epoch,
                    lease.expires_at is not None and lease.expires_at > now,
                )
                for p, lease in enumerate(self._leases)
            ]

    def _lease_held(self, row: MemoryRow[V], now: float) -> bool:
        """The ordered settles' extra fence: the claimer still holds the item's partition."""
        if row.partition is None:
            return True
        lease = self._leases[row.partition]
        return (
            lease.owner == row.claimed_by
            and lease.expires_at is not None
            and lease.expires_at > now
        )

    # -- the wake-up gate ---------------------------------------------------------------

    def _wake_listeners(self) -> None:
        for listener in self._listeners:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is listener.loop:
                listener.event.set()
            elif not listener.loop.is_closed():
                listener.loop.call_soon_threadsafe(listener.event.set)


class MemoryQueueStore(Generic[V, T]):
    """One claimer's store on a :class:`MemoryQueue` (what PgQueueStore is on a table).

    ``make_item(value, attempt)`` builds the item a claim hands out (``attempt``: 1 on the
    first claim). ``retention``: processed items are deleted, or kept as published.
    ``ordered``: settles are also fenced by the partition lease, and a :class:`HeadsOnly`
    claim runs the ordered claim (the queue needs ``partitions``).
    """

    def __init__(
        self,
        queue: MemoryQueue[V],
        make_item: Callable[[V, int], T],
        *,
        retention: Retention = "delete",
        ordered: bool = False,
        name: str = "memory",
    ) -> None:
        if retention not in ("delete", "keep"):
            raise ConfigurationError(f"retention must be 'delete' or 'keep', not {retention!r}")
        if ordered and queue.partitions is None:
            raise ConfigurationError(
                "an ordered store needs an ordered queue: MemoryQueue(partitions=N)"
            )
        self.queue = queue
        self.make_item = make_item
        self.retention: Retention = retention
        self.ordered = ordered
        self.name = name

    def __repr__(self) -> str:
        return f"MemoryQueueStore({self.name!r}, {self.queue!r})"

    async def _round_trip(self) -> None:
        """Where a database store awaits the server: other tasks run, outages strike."""
        await asyncio.sleep(0)
        if self.queue.unavailable:
            self._lose_gate()
            raise StoreUnavailable(
                "in-memory store unavailable (MemoryQueue.unavailable is set by the test)"
            )

    # -- start ----------------------------------------------------------------------

    async def start(self) -> StoreInfo:
        await self._round_trip()
        with self.queue.lock:
            pending = min(len(self.queue._pending), PENDING_CAP)
        return StoreInfo(pending, pending >= PENDING_CAP, "in memory")

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
        await self._round_trip()
        if isinstance(policy, HeadsOnly) and not self.ordered:
            raise ConfigurationError("a HeadsOnly claim needs MemoryQueueStore(ordered=True)")
        queue = self.queue
        with queue.lock:
            now = queue.clock()
            if isinstance(policy, HeadsOnly):
                batch = self._ordered_batch(policy, limit, owner, now)
            else:
                due = (r for r in queue._pending.values() if r.available_at <= now)
                batch = heapq.nsmallest(limit, due, key=lambda r: (r.available_at, r.id))
            # The crash-loop guard (DEAD_ON_CLAIM): an item already claimed max_attempts
            # times was never settled by any claimer that held it; it is dead-lettered,
            # not handed to the next victim, and returned as the claim's ``dead``. Under
            # block, the later items of its key in this batch wait behind it.
            block = isinstance(policy, HeadsOnly) and policy.block
            first_dead: dict[str, int] = {}
            claimed: list[MemoryRow[V]] = []
            dead: list[tuple[T, str, str]] = []
            make = self.make_item
            for row in sorted(batch, key=lambda r: r.id):
                if row.attempts >= max_attempts:
                    kind, error = _looped(row, max_attempts)
                    row.status = Status.FAILED
                    row.claim_token = None
                    row.claimed_by = owner
                    row.last_error = error
                    del queue._pending[row.id]
                    dead.append((make(row.value, row.attempts), kind, error))
                    if row.key is not None:
                        first_dead.setdefault(row.key, row.id)
                    continue
                if block and row.key is not None and row.key in first_dead:
                    continue
                row.attempts += 1
                row.available_at = now + lease
                row.claim_token = token
                row.claimed_by = owner
                claimed.append(row)
            if not claimed and not dead:
                return None
            items = [make(r.value, r.attempts) for r in claimed]
            return Claim(token, [r.id for r in claimed], items, dead)

    def _ordered_batch(
        self, policy: HeadsOnly, limit: int, owner: str, now: float
    ) -> list[MemoryRow[V]]:
        """ORDERED_CLAIM's choice: a prefix of each key's due items, plus keyless ones.

        A keyed item is claimable when no earlier unsettled item of its key is leased,
        waiting for its time, or (under block) dead-lettered; only in partitions ``owner``
        holds for ``policy.margin`` seconds more and is not draining.
        """
        queue = self.queue
        draining = set(policy.draining)
        mine = {
            p
            for p, lease in enumerate(queue._leases)
            if lease.owner == owner
            and lease.expires_at is not None
            and lease.expires_at > now + policy.margin
            and p not in draining
        }
        pending = sorted(queue._pending.values(), key=lambda r: r.id)
        scanned = [r for r in pending if r.partition in mine and r.available_at <= now]
        del scanned[SCAN_FACTOR * limit :]
        last: dict[str, int] = {}
        for r in scanned:
            assert r.key is not None  # a partition means a key
            last[r.key] = r.id
        # The first item of each scanned key that blocks the items after it.
        first_block: dict[str, int] = {}
        for r in queue._rows.values():  # id order
            if r.key not in last or r.key in first_block or r.id >= last[r.key]:
                continue
            if (r.status is Status.PENDING and r.available_at > now) or (
                r.status is Status.FAILED and policy.block
            ):
                first_block[r.key] = r.id
        keyed = [r for r in scanned if r.id < first_block.get(r.key or "", r.id + 1)][:limit]
        keyless_limit = max(limit - len(keyed), limit // 4)
        keyless = heapq.nsmallest(
            keyless_limit,
            (r for r in pending if r.key is None and r.available_at <= now),
            key=lambda r: (r.available_at, r.id),
        )
        return keyed + keyless

    # -- settle -------------------------------------------------------------------------

    def _fenced(self, claim: Claim[T], ids: Iterable[int], now: float) -> list[MemoryRow[V]]:
        """The items of ``ids`` this claim still holds (token, and the partition lease)."""
        queue = self.queue
        held = []
        for item_id in ids:
            row = queue._rows.get(item_id)
            if row is None or row.claim_token != claim.token:
                continue
            if self.ordered and not queue._lease_held(row, now):
                continue
            held.append(row)
        return held

    async def settle(self, claim: Claim[T], decisions: Sequence[Decision]) -> Settled:
        await self._round_trip()
        queue = self.queue
        with queue.lock:
            now = queue.clock()
            verdicts = dict(zip(claim.ids, decisions, strict=True))
            done: list[int] = []
            for row in self._fenced(claim, claim.ids, now):
                decision = verdicts[row.id]
                done.append(row.id)
                if decision.verdict is Verdict.DONE:
                    if self.retention == "delete":
                        del queue._rows[row.id]
                        del queue._pending[row.id]
                    else:
                        row.status = Status.PUBLISHED
                        row.published_at = now
                        row.claim_token = None
                        row.last_error = None
                        del queue._pending[row.id]
                    continue
                # SETTLE_FAILURES: pending again (or failed) at now + delay, with the error.
                row.available_at = now + decision.delay
                row.last_error = decision.error or "unknown error"
                row.claim_token = None
                if decision.verdict is Verdict.HAND_BACK:
                    row.attempts = max(row.attempts - 1, 0)
                if decision.verdict is Verdict.DEAD:
                    row.status = Status.FAILED
                    del queue._pending[row.id]
            return Settled(done, len(claim.ids) - len(done))

    async def extend_leases(self, claim: Claim[T], lease: float) -> int:
        await self._round_trip()
        with self.queue.lock:
            now = self.queue.clock()
            rows = self._fenced(claim, claim.ids, now)
            for row in rows:
                row.available_at = now + lease
            return len(rows)

    async def release(self, claim: Claim[T]) -> int:
        await self._round_trip()
        with self.queue.lock:
            now = self.queue.clock()
            rows = self._fenced(claim, claim.ids, now)
            for row in rows:
                row.available_at = now
                row.claim_token = None
                row.attempts = max(row.attempts - 1, 0)
            return len(rows)

    async def hasten(self, ids: Sequence[int]) -> int:
        if not ids:
            return 0
        await self._round_trip()
        queue = self.queue
        with queue.lock:
            now = queue.clock()
            count = 0
            for item_id in ids:
                row = queue._pending.get(item_id)
                if row is not None and row.claim_token is None and row.available_at > now:
                    row.available_at = now
                    count += 1
            return count

    # -- the wake-up gate ---------------------------------------------------------------

    @property
    def gate_closed(self) -> bool:
        return self.queue._gate is self

    async def close_gate(self) -> bool:
        await self._round_trip()
        with self.queue.lock:
            if self.queue._gate is None:
                self.queue._gate = self
            return self.queue._gate is self

    async def open_gate(self) -> None:
        self._lose_gate()

    def _lose_gate(self) -> None:
        with self.queue.lock:
            if self.queue._gate is self:
                self.queue._gate = None

    @property
    def can_listen(self) -> bool:
        return True

    async def listen(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` now (as after LISTEN) and on every write while a gate is held."""
        listener = _Listener(asyncio.get_running_loop())
        with self.queue.lock:
            self.queue._listeners.append(listener)
        try:
            wake()
            while True:
                await listener.event.wait()
                listener.event.clear()
                wake()
        finally:
            with self.queue.lock:
                self.queue._listeners.remove(listener)

    async def close(self) -> None:
        self._lose_gate()


def _keeps_to_the_interface(store: MemoryQueueStore[object, T]) -> QueueStore[T]:
    """Never called: mypy checks here that the memory store is a QueueStore."""
    return store
