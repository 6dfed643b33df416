"""The claim loop's parts, built and wired once (queue/loop.py's constructor): what it does
with a failing or refusing store, the hand-back, the settle path, the carried settle and,
in split mode, the local queue and its runners. The loop keeps each as an attribute."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from outboxkit.queue.carry import SettleCarry
from outboxkit.queue.decide import Outcome, RetryPolicy
from outboxkit.queue.faults import DatabaseErrors, DeniedWrites
from outboxkit.queue.handback import HandBack
from outboxkit.queue.heartbeat import LeaseExtender
from outboxkit.queue.local_queue import LocalQueue
from outboxkit.queue.loop_types import LoopOptions, QueueObserver, Sink
from outboxkit.queue.settling import Settling
from outboxkit.queue.store import Attempted, Claim, ClaimsSettling, QueueStore

T = TypeVar("T", bound=Attempted)
R = TypeVar("R", bound=Outcome)


@dataclass(slots=True)
class LoopParts(Generic[T, R]):
    errors: DatabaseErrors
    denied: DeniedWrites
    hand_back: HandBack
    settling: Settling[T, R]
    carry: SettleCarry[T] | None
    extend: Callable[[Claim[T]], Awaitable[int | None]]
    local: LocalQueue[T, R] | None


def wire_loop(
    store: QueueStore[T],
    sink: Sink[T, R],
    observer: QueueObserver[T, R],
    options: LoopOptions,
    *,
    log: logging.Logger,
    wake: Callable[[], None],
    stopping: asyncio.Event,
    slots: asyncio.Semaphore,
    sleep: Callable[[float], Awaitable[None]],
    fail: Callable[[str, BaseException], None],
    retry_for: Callable[[T], RetryPolicy] | None,
    on_lease_lost: Callable[[Claim[T], int], None] | None,
) -> LoopParts[T, R]:
    # A store that fails (queue/faults.py): retried with backoff, an outage one episode.
    errors = DatabaseErrors(observer, log, sleep)
    # Configuration faults: the store refused a claim or a settle (no privilege,
    # read-only). The loop claims nothing while one lasts.
    denied = DeniedWrites(store, errors, log, options.words.who, sleep)
    # Items handed back untried while the sink's target is down (queue/handback.py).
    hand_back = HandBack(store, sink, options.retry, log, wake)
    # The settle path (queue/settling.py): decide, write, report, release at shutdown.
    settling: Settling[T, R] = Settling(
        store,
        sink,
        observer,
        options,
        errors=errors,
        denied=denied,
        hand_back=hand_back,
        stopping=stopping,
        sleep=sleep,
        log=log,
        retry_for=retry_for,
    )
    # A claim after a wait settles the claim before it in the same statement, where the
    # store can (queue/carry.py): one statement a cycle at steady rates, not two.
    carry: SettleCarry[T] | None = None
    if isinstance(store, ClaimsSettling) and store.carries_settles and not options.split:
        carry = SettleCarry(store, lambda: not slots.locked())
        settling.carry = carry.offer
    # One extension of a claim's leases (queue/heartbeat.py): the heartbeat's, the runners'.
    extend = LeaseExtender(store, observer, options, log).extend
    # Split mode: the items between their claim and their settle, and the runners.
    local: LocalQueue[T, R] | None = None
    if options.split:
        lost = on_lease_lost
        local = LocalQueue(
            sink,
            observer,
            settling,
            slots=options.max_in_flight,
            lease=options.lease,
            name=options.name,
            extend=extend,
            lease_lost=None if lost is None else (lambda claim: lost(claim, 0)),
            fail=fail,
            log=log,
            track_run_time=options.prefetch > 0,
        )
    return LoopParts(errors, denied, hand_back, settling, carry, extend, local)
