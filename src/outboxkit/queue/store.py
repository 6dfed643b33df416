"""The store interface a queue backend implements: claim, settle, extend, release, wake up.

The claim loop (outboxkit.queue) knows no SQL: every database action goes through a
:class:`QueueStore`. PostgreSQL's is ``outboxkit.backends.postgres.queue_pg``; an in-memory one and
MariaDB's implement the same methods and pass the same contract tests.

The rules every backend keeps (DESIGN.md §3):

* a claim leases its items for ``lease`` seconds under a fresh token and counts one
  attempt each; an item is claimable when it is pending and its time has come (a lease
  that ran out makes it claimable again: nothing else rescues a dead worker's items);
* every settle, extension and release is fenced by that token: an item another claim
  has taken since is left alone and reported as lost, never overwritten;
* an item claimed ``max_attempts`` times and never settled (each claimer died on it)
  is dead-lettered by the claim itself, not handed to the next victim.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

from outboxkit.errors import StoreDenied, StoreError, StoreTimeout, StoreUnavailable

__all__ = [
    "DONE",
    "Attempted",
    "Claim",
    "ClaimPolicy",
    "ClaimsSettling",
    "Decision",
    "HeadsOnly",
    "QueueStore",
    "Settled",
    "StoreDenied",
    "StoreError",
    "StoreInfo",
    "StoreTimeout",
    "StoreUnavailable",
    "Verdict",
]


class Attempted(Protocol):
    """What the core reads of a claimed item: the attempt this claim is (1 = first try)."""

    @property
    def attempt(self) -> int: ...


#: The item a claim carries: an OutboundMessage for the outbox, a task in task mode.
T = TypeVar("T", bound=Attempted)
T_co = TypeVar("T_co", bound=Attempted, covariant=True)


class Claim(Generic[T]):
    """One claim: item ids and items in the store's order (parallel lists), and its token.

    Parallel lists rather than one object per item: the relay builds hundreds of
    thousands of items a second, and the sink wants the items as a list anyway.
    """

    __slots__ = ("claimed_at", "dead", "ids", "items", "token")

    def __init__(
        self,
        token: uuid.UUID,
        ids: list[int],
        items: list[T],
        dead: list[tuple[T, str, str]] | None = None,
    ) -> None:
        self.token = token
        self.ids = ids
        self.items = items
        #: Items the claim dead-lettered itself instead of leasing them, as
        #: (item, error class, stored error): the crash-loop guard ("crash_loop": claimed
        #: max_attempts times, never settled; "max_attempts": retried up to a higher limit
        #: before), or a row too large to load ("oversized"). Reported, never processed.
        self.dead: list[tuple[T, str, str]] = dead if dead is not None else []
        #: time.monotonic() when the claim returned (lease bookkeeping, logs).
        self.claimed_at = time.monotonic()

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"Claim(token={self.token}, items={len(self.ids)})"


@dataclass(frozen=True, slots=True)
class HeadsOnly:
    """The ordered claim policy: only each key's head and the items right behind it.

    An item with a key is claimable only when every earlier unsettled item of its key
    is claimable too (none leased elsewhere, none waiting for a retry; under
    ``block`` none dead-lettered), and only in the key partitions this claimer holds a
    lease on for at least ``margin`` seconds more, minus the ``draining`` ones it is
    handing over. Keyless items are claimed as in the unordered claim.
    """

    block: bool = True
    margin: float = 0.0
    draining: Sequence[int] = ()


#: How a claim chooses: None (oldest due first) or an ordering policy.
ClaimPolicy = HeadsOnly | None


class Verdict(enum.Enum):
    """What a settle does with one item (the kind of a :class:`Decision`)."""

    DONE = "done"  # processed: removed (or kept as done, by the store's retention)
    RETRY = "retry"  # back to pending after ``delay``; the attempt counts
    DEAD = "dead"  # dead-lettered with ``error``: out of attempts, or rejected for good
    HAND_BACK = "hand_back"  # back to pending after ``delay``, the attempt refunded


@dataclass(frozen=True, slots=True)
class Decision:
    """The settle of one item, as outboxkit.queue.decide computes it (a value, no I/O)."""

    verdict: Verdict
    #: Seconds from now until the item is due again (RETRY, HAND_BACK).
    delay: float = 0.0
    #: Stored as the item's last error (redacted, bounded); None for DONE.
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.verdict is Verdict.DONE


#: The decision of every processed item (one shared value: ``[DONE] * n`` costs nothing).
DONE = Decision(Verdict.DONE)


@dataclass(slots=True)
class Settled:
    """What a settle changed: the ids it settled; ``lost`` were re-claimed by another claim."""

    ids: Sequence[int]
    lost: int = 0


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """What the store found at start, for the start-up log line."""

    pending: int
    pending_capped: bool = False
    where: str = ""


# -- the interface -----------------------------------------------------------------------


class QueueStore(Protocol[T]):
    """A backend's queue table, as the claim loop uses it. Every method is fenced or idempotent.

    Errors: a lost connection raises :class:`StoreUnavailable`, a cancelled statement
    :class:`StoreTimeout`, missing privileges or a read-only server :class:`StoreDenied`,
    any other failed operation
    :class:`StoreError`; a missing table raises ``outboxkit.errors.SchemaError``.
    """

    async def start(self) -> StoreInfo:
        """Check the table and the role's rights (:class:`StoreDenied` if it cannot settle)."""
        ...

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
        """Lease up to ``limit`` due items under ``token``; None when none is due or dead.

        A claim with no ids may still carry ``dead`` items (all it found was dead-lettered).
        """
        ...

    async def settle(self, claim: Claim[T], decisions: Sequence[Decision]) -> Settled:
        """Apply one decision per item (in ``claim.ids`` order), fenced by ``claim.token``."""
        ...

    async def extend_leases(self, claim: Claim[T], lease: float) -> int:
        """Push the claim's leases to now + ``lease`` (fenced); how many it still held."""
        ...

    async def release(self, claim: Claim[T]) -> int:
        """Hand the claim's items back at once, attempt refunded (fenced); how many."""
        ...

    async def hasten(self, ids: Sequence[int]) -> int:
        """Make items handed back during an outage due now (still pending, unclaimed); how many.

        The outage was not theirs: once the target is back they go first, not after the
        delay that paced their retries while it was down.
        """
        ...

    async def close_gate(self) -> bool:
        """Ask writers to wake this claimer from now on; False if another claimer holds it.

        A store with no wake-ups returns False (the loop then polls).
        """
        ...

    async def open_gate(self) -> None:
        """Writers may stop waking this claimer (it found work)."""
        ...

    @property
    def gate_closed(self) -> bool:
        """Whether this claimer holds the gate now (a lost connection loses it)."""
        ...

    @property
    def can_listen(self) -> bool:
        """Whether :meth:`listen` delivers wake-ups (PostgreSQL's LISTEN/NOTIFY)."""
        ...

    async def listen(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` on every wake-up until cancelled; reconnects by itself."""
        ...

    async def close(self) -> None:
        """Close every connection (the store may be started again)."""
        ...


@runtime_checkable
class ClaimsSettling(Protocol[T]):
    """A store whose claim can also settle the claim before it, published whole, in the same
    statement (queue/carry.py): at steady rates, one statement and one commit a cycle."""

    @property
    def carries_settles(self) -> bool:
        """Whether :meth:`claim_settling` may be used (PostgreSQL's, not in ordered mode)."""
        ...

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
        """:meth:`QueueStore.claim`, and ``carried``'s items settled done (fenced by its
        token) as :meth:`QueueStore.settle` would; a failure does neither. Settled None:
        nothing was settled (no statement ran); the caller settles ``carried`` itself."""
        ...
