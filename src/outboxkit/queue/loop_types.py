"""What the claim loop (queue/loop.py) is given and what it shows: the sink that works a
claim's items, the observer's hooks, ordered mode's claim policy, the loop's options and
the words of its log lines, and its status for readiness and metrics. No I/O."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from outboxkit.queue.decide import Outcome, RetryPolicy
from outboxkit.queue.pacing import GATE_RETRY
from outboxkit.queue.settling import SettleObserver
from outboxkit.queue.store import Attempted, ClaimPolicy

T_contra = TypeVar("T_contra", bound=Attempted, contravariant=True)
O_co = TypeVar("O_co", bound=Outcome, covariant=True)
O_contra = TypeVar("O_contra", bound=Outcome, contravariant=True)


class Sink(Protocol[T_contra, O_co]):
    """What processes a claim's items: a publisher (the relay) or a handler runner (tasks).

    ``process`` returns one outcome per item, in order, and does not raise for an item's
    failure (an exception fails the loop). ``target_down`` says the sink's own client
    reports its target unreachable (a retryable failure then is the outage's, not the
    item's); ``restored_since(t)`` that it reported the target back after ``t`` (monotonic).
    """

    @property
    def name(self) -> str: ...

    async def process(self, token: uuid.UUID, items: Sequence[T_contra]) -> Sequence[O_co]: ...

    def target_down(self) -> bool: ...

    def restored_since(self, when: float) -> bool: ...

    def dead_outcome(self, error: str, error_class: str) -> O_co:
        """The outcome observers get for an item the store dead-lettered at claim."""
        ...


class QueueObserver(SettleObserver[T_contra, O_contra], Protocol[T_contra, O_contra]):
    """The hooks the loop calls (``outboxkit.sink.observer.RelayObserver`` is one, the task
    worker's another): the settle's (queue/settling.py) and these. ``processing`` wraps the
    sink's work on a claim (the relay's publish, the worker's handlers); ``processed``
    follows it, before the settle."""

    def claimed(self, count: int, seconds: float) -> None: ...

    def processing(self, items: Sequence[T_contra]) -> AbstractContextManager[None]: ...

    def processed(
        self, items: Sequence[T_contra], outcomes: Sequence[O_contra], seconds: float
    ) -> None: ...


class Ordering(Protocol):
    """A claim policy with state (ordered mode): asked before each claim, told of each batch.

    ``track`` gets the task processing each claim it chose; the loop claims again when one
    ends (its keys are free again).
    """

    def before_claim(self, token: uuid.UUID, limit: int) -> ClaimPolicy: ...

    def track(self, task: asyncio.Task[None]) -> None: ...


@dataclass(frozen=True, slots=True)
class Wording:
    """The words of the loop's log lines: a relay publishes rows, a worker runs tasks."""

    who: str  # "relay"
    items: str  # "row(s)"
    working: str  # "publishing"
    lost: str  # what a lost lease means for the items
    again: str  # "published again"


RELAY_WORDS = Wording(
    who="relay",
    items="row(s)",
    working="publishing",
    lost="were re-claimed by another relay before this one settled them",
    again="they are published at least once",
)
WORKER_WORDS = Wording(
    who="worker",
    items="task(s)",
    working="running",
    lost="were cancelled, or re-claimed by another worker, before this one settled them",
    again="a cancelled task stays cancelled, a re-claimed one runs again",
)


def default_owner_id() -> str:
    """host-pid-random: a claimer's id (a relay's, a worker's) unique per process, readable
    in ``claimed_by``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class LoopOptions:
    """The claim loop's options (validated by whoever builds it: the relay, the worker)."""

    owner: str
    batch_size: int
    max_in_flight: int
    lease: float
    poll_interval: float
    linger: float
    listen: bool
    shutdown_timeout: float
    retry: RetryPolicy
    #: Task names and log lines start with it.
    name: str = "outboxkit-relay"
    #: Hand each claimed item to the sink on its own, with a slot of its own (task mode: a
    #: slow item never holds a fast one's settle). A claim then takes up to as many items as
    #: slots are free (at most ``batch_size``): one statement claims several. The items run
    #: on ``max_in_flight`` runners and settle in groups as they finish (queue/local_queue.py).
    split: bool = False
    #: Split mode: a claim may take up to this many items beyond the free slots; they wait
    #: in a local queue (as graphile-worker's ``localQueue``) for a runner, so one statement
    #: claims a batch even while every slot is busy. Bounded by the lease: the last one
    #: waits about prefetch x run time / slots, kept under a quarter of it.
    prefetch: int = 0
    #: The first wait when the wake-up gate cannot be closed because a writer holds it open
    #: (between its INSERT and its COMMIT, usually a round trip): doubled up to 100 ms.
    gate_retry: float = GATE_RETRY[0]
    #: The longest of the linger's waits (None: they double until the linger is spent). A
    #: commit during a wait is seen at its end: the task worker keeps them short.
    linger_step: float | None = None
    #: The gather window (0: off): after a claim that found work but fewer items than it
    #: asked for, while items arrive at least two a window, the next look waits until
    #: about 32 items are due, at most this long, instead of the linger's first 2 ms. At
    #: steady rates a claim then takes several items for one claim and one settle
    #: statement (a claim costs the database about the same for 2 items as for 100). The
    #: first item after a quiet spell is never held: only the looks after work wait. The
    #: relay sets it; the task worker keeps it off (its latency budget is a few ms).
    gather: float = 0.0
    #: How the log lines name the process, its items and their work (the worker's own).
    words: Wording = RELAY_WORDS


@dataclass(frozen=True, slots=True)
class LoopStatus:
    """What readiness and metrics read of a running loop (no I/O)."""

    #: Why the store refuses the loop's writes (claiming stopped), or None.
    denied: str | None
    in_flight: int
    stopping: bool
