"""The claim loop's settle path: what :func:`decide` says of each item, written back.

One settle per claim (per item in split mode): the common all-done claim in one pass with
no per-item lists; otherwise a decision per item, the outage's hand-back remembered
(queue/handback.py), the items the token fence dropped reported as lost leases. The
write retries through database outages and refusals (queue/faults.py) until it goes
through or, at shutdown, past the lease: the settle is fenced by the claim token, so a
retry after another claim took the items changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Protocol, TypeVar

from outboxkit._redact import redact
from outboxkit._text import first_line
from outboxkit.queue.decide import Outcome, Reschedule, RetryPolicy, decide, outage
from outboxkit.queue.faults import DatabaseErrors, DeniedWrites
from outboxkit.queue.handback import HandBack
from outboxkit.queue.store import (
    DONE,
    Attempted,
    Claim,
    Decision,
    QueueStore,
    Settled,
    StoreDenied,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    Verdict,
)

T = TypeVar("T", bound=Attempted)
R = TypeVar("R", bound=Outcome)
T_contra = TypeVar("T_contra", bound=Attempted, contravariant=True)
O_contra = TypeVar("O_contra", bound=Outcome, contravariant=True)


class _Target(Protocol):
    """What the settle reads of the sink (``queue.loop.Sink``)."""

    def target_down(self) -> bool: ...


class SettleObserver(Protocol[T_contra, O_contra]):
    """What the settle reports: the part of ``queue.loop.QueueObserver`` it calls."""

    def settled(
        self,
        published: Sequence[T_contra],
        retried: Sequence[tuple[T_contra, O_contra]],
        dead: Sequence[tuple[T_contra, O_contra]],
    ) -> None: ...

    def handed_back(self, count: int, error: str | None) -> None: ...

    def lost_leases(self, count: int) -> None: ...

    def database_error(self, operation: str, error: Exception, connection_lost: bool) -> None: ...


class _Words(Protocol):
    @property
    def items(self) -> str: ...
    @property
    def lost(self) -> str: ...
    @property
    def again(self) -> str: ...


class _Options(Protocol):
    """What the settle reads of ``queue.loop.LoopOptions``."""

    @property
    def retry(self) -> RetryPolicy: ...
    @property
    def lease(self) -> float: ...
    @property
    def shutdown_timeout(self) -> float: ...
    @property
    def words(self) -> _Words: ...


class Settling(Generic[T, R]):
    """Settles a claim's outcomes, and releases a claim handed back at shutdown."""

    def __init__(
        self,
        store: QueueStore[T],
        sink: _Target,
        observer: SettleObserver[T, R],
        options: _Options,
        *,
        errors: DatabaseErrors,
        denied: DeniedWrites,
        hand_back: HandBack,
        stopping: asyncio.Event,
        sleep: Callable[[float], Awaitable[None]],
        log: logging.Logger,
        retry_for: Callable[[T], RetryPolicy] | None = None,
    ) -> None:
        self.store = store
        self.sink = sink
        self.observer = observer
        self.options = options
        #: The retry policy of one item when items carry their own (a task's handler
        #: schedule and max_attempts); None: ``options.retry`` for every item.
        self.retry_for = retry_for
        self.log = log
        self.stopping = stopping
        self._errors = errors
        self._denied = denied
        self._hand_back = hand_back
        self._sleep = sleep
        #: Parks the settle of a claim done whole for the loop's next claim to carry
        #: (queue/carry.py): a future of what it settled (None: settle alone), or None
        #: when no claim is about to run. None: every settle runs on its own.
        self.carry: Callable[[Claim[T]], Awaitable[Settled | None] | None] | None = None
        #: Told once, of the first claim settled done: how many items, how long after the
        #: claim (the relay's first-batch log line).
        self.first_settled: Callable[[int, float], None] | None = None

    async def settle(self, claim: Claim[T], outcomes: Sequence[R]) -> None:
        items = claim.items
        if all(o.ok for o in outcomes):  # the common case: one pass, no per-item lists
            offer = self.carry
            parked = None if offer is None else offer(claim)
            settled = None if parked is None else await parked
            if settled is None:
                settled = await self._store_settle(claim, [DONE] * len(items))
            if settled is not None:
                self._hand_back.succeeded()
                self._report_done(claim, settled, claim.ids, items)
                if self._hand_back.waiting:
                    await self._hand_back.target_back()
            return
        target_down = self.sink.target_down()
        state = outage(outcomes, target_down=target_down)
        outage_delay = self._hand_back.delay(state)
        policy = self.options.retry
        pick = self.retry_for
        decisions = [
            decide(
                item.attempt,
                o,
                policy if pick is None else pick(item),
                target_down=target_down,
                outage_delay=outage_delay,
            )
            for item, o in zip(items, outcomes, strict=True)
        ]
        settled = await self._store_settle(claim, decisions)
        if settled is None:
            return
        kept: set[int] | None = None
        if settled.lost:  # the fence dropped items: report only those settled
            self._check_fenced(claim, settled.lost, len(claim.ids))
            kept = set(settled.ids)
        done: list[T] = []
        done_ids: list[int] = []
        retried: list[tuple[T, R]] = []
        dead: list[tuple[T, R]] = []
        handed_back: list[int] = []
        first_hand_back: str | None = None
        for item_id, item, outcome, decision in zip(
            claim.ids, items, outcomes, decisions, strict=True
        ):
            if kept is not None and item_id not in kept:
                continue
            verdict = decision.verdict
            if verdict is Verdict.DONE:
                done.append(item)
                done_ids.append(item_id)
            elif verdict is Verdict.RETRY:
                retried.append((item, outcome))
            elif verdict is Verdict.DEAD:
                dead.append((item, outcome))
            elif isinstance(outcome, Reschedule):
                continue  # put off on purpose (a task's Snooze): not the outage's, not hastened
            else:
                handed_back.append(item_id)
                if first_hand_back is None:
                    first_hand_back = decision.error
        if done:
            self._report_done(claim, Settled(done_ids), done_ids, done)
        if retried or dead:
            self.observer.settled((), retried, dead)
        if handed_back:  # the sink logged why, once; not a line per item
            self.observer.handed_back(len(handed_back), first_hand_back)
            count = len(handed_back)
            self.log.debug("handed back %d event(s) untried, attempts not counted", count)
            self._hand_back.remember(handed_back, outage_delay)
        if state is False and self._hand_back.waiting:
            await self._hand_back.target_back()

    def _report_done(
        self, claim: Claim[T], settled: Settled, ids: Sequence[int], items: Sequence[T]
    ) -> None:
        if settled.lost:  # the fence dropped items: report only those settled
            self._check_fenced(claim, settled.lost, len(ids))
            kept = set(settled.ids)
            items = [m for i, m in zip(ids, items, strict=True) if i in kept]
        if self.first_settled is not None and items:
            first, self.first_settled = self.first_settled, None
            first(len(items), time.monotonic() - claim.claimed_at)
        self.observer.settled(items, (), ())

    def _check_fenced(self, claim: Claim[T], lost: int, expected: int) -> None:
        if lost > 0:
            self.observer.lost_leases(lost)
            words = self.options.words
            self.log.warning(
                "lease_lost: %d of %d %s %s (claimed %.1fs ago, lease %.1fs); %s",
                lost,
                expected,
                words.items,
                words.lost,
                time.monotonic() - claim.claimed_at,
                self.options.lease,
                words.again,
            )

    async def _store_settle(self, claim: Claim[T], decisions: Sequence[Decision]) -> Settled | None:
        """Settle ``claim``, retrying through database outages and refusals.

        None if it gave up at shutdown. Retrying is safe: the settle is fenced by the
        claim token, so once another claim has taken the items it changes nothing.
        """
        denied = False
        try:
            while True:
                try:
                    settled = await self.store.settle(claim, decisions)
                except StoreDenied as exc:
                    if not denied:
                        denied = True
                        self._denied.settling += 1
                        self.observer.database_error("settle", exc.cause, False)
                    self._denied.deny(exc, "settles")
                    if self._giving_up(claim):
                        return None
                    await self._sleep(self._errors.next_delay())
                    continue
                except (StoreUnavailable, StoreTimeout) as exc:
                    if self._giving_up(claim):
                        return None
                    await self._errors.failed("settle", exc)
                    continue
                self._errors.succeeded()
                return settled
        finally:
            if denied:
                self._denied.settling -= 1
                if not self.stopping.is_set():
                    self._denied.allowed()  # the settle went through: claim again

    def _giving_up(self, claim: Claim[T]) -> bool:
        if self.stopping.is_set() and (
            time.monotonic() - claim.claimed_at > self.options.lease + self.options.shutdown_timeout
        ):
            self.log.warning(
                "giving up settling %d %s at shutdown: the database is unreachable;"
                " their leases expire and they are claimed again",
                len(claim.ids),
                self.options.words.items,
            )
            return True
        return False

    def failed(self, exc: StoreError) -> None:
        """A settle statement failed (not a lost connection: those are retried): logged and
        reported; its items keep their lease and are processed again after it expires."""
        self.log.error("settle failed: %s", first_line(exc.cause, with_type=True))
        self.observer.database_error("settle", exc.cause, False)

    async def release(self, claim: Claim[T]) -> None:
        """Hand ``claim``'s items back now (a forced shutdown), not at their lease's expiry."""
        try:
            count = await self.store.release(claim)
        except StoreError as exc:
            self.observer.database_error("release", exc.cause, isinstance(exc, StoreUnavailable))
            self.log.warning(
                "could not release %d lease(s) (%s); they expire in %.0fs",
                len(claim.ids),
                redact(str(exc.cause)),
                self.options.lease,
            )
            return
        self.observer.handed_back(count, None)
        self.log.info("released %d lease(s) at shutdown", count)
