"""The retry / dead-letter decision, written once: a pure function from an outcome to a Decision.

The relay, the WAL relay and the task worker only persist what :func:`decide` returns
(procrastinate's ``RetryStrategy`` -> ``RetryDecision`` is the model). No I/O, no clock but
the jitter's random draw: unit-tested without a server (tests/unit/test_decide.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from outboxkit._backoff import bounded_retry_after, full_jitter
from outboxkit._redact import redact
from outboxkit.queue.store import DONE, Decision, Verdict

#: A stored error is cut here (a publisher's or a handler's text may be long).
MAX_ERROR_CHARS = 2000
#: The longest wait a target may ask for (``retry_after``): 30 days.
MAX_RETRY_DELAY = 30 * 86400.0


class Outcome(Protocol):
    """What a sink reports per item (``PublishResult`` is one; a task handler's result another).

    ``counts_attempt`` False: the item was never judged (the sink's own client failed),
    so its attempt is refunded.
    """

    @property
    def ok(self) -> bool: ...
    @property
    def error(self) -> str | None: ...
    @property
    def retryable(self) -> bool: ...
    @property
    def retry_after(self) -> float | None: ...
    @property
    def counts_attempt(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How failures are retried: full-jitter backoff from ``base`` up to ``cap`` seconds,
    dead letter once ``max_attempts`` tries failed; a target's ``retry_after`` is honoured up
    to ``max_delay``."""

    max_attempts: int = 10
    base: float = 1.0
    cap: float = 300.0
    max_delay: float = MAX_RETRY_DELAY
    #: A schedule as data: the n-th retry waits ``delays[n - 1]`` seconds (the last one
    #: repeats); empty, the full-jitter backoff above.
    delays: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class Reschedule:
    """An outcome whose sink chose the item's next time itself, not a failure of its target.

    A task handler's ``Retry(delay)`` (``counts_attempt`` True: the attempt counts, the last
    one dead-letters) or ``Snooze(delay)`` (False: handed back with the attempt refunded).
    Never a sign of an outage (:func:`outage` leaves it out), and its delay is taken as it is.
    """

    delay: float
    counts_attempt: bool = True
    error: str | None = None
    ok: bool = False
    retryable: bool = True

    @property
    def retry_after(self) -> float | None:
        return self.delay


def stored_error(error: str | None) -> str:
    """An outcome's error as a store keeps it: redacted (no secret), bounded."""
    return redact(error or "unknown error")[:MAX_ERROR_CHARS]


def decide(
    attempt: int,
    outcome: Outcome,
    policy: RetryPolicy,
    *,
    target_down: bool = False,
    outage_delay: float = 0.0,
) -> Decision:
    """The settle of one item that was tried for the ``attempt``-th time.

    * ok: DONE;
    * never judged (``counts_attempt`` False), or a retryable failure while the sink reports
      its target down (``target_down``: the outage's fault, not the item's): HAND_BACK, the
      attempt refunded, due after the target's ``retry_after`` or ``outage_delay`` (the
      caller's pacing of an outage), whichever is longer;
    * rejected for good (not retryable) or out of attempts: DEAD;
    * otherwise RETRY after the policy's delay for ``attempt`` (or ``retry_after``);
    * a :class:`Reschedule`: RETRY (DEAD on the last attempt) or HAND_BACK after its own delay.
    """
    if outcome.ok:
        return DONE
    if isinstance(outcome, Reschedule):
        delay = bounded_retry_after(outcome.delay, policy.max_delay)
        if not outcome.counts_attempt:
            error = None if outcome.error is None else stored_error(outcome.error)
            return Decision(Verdict.HAND_BACK, delay, error)
        if attempt >= policy.max_attempts:
            return Decision(Verdict.DEAD, 0.0, stored_error(outcome.error))
        return Decision(Verdict.RETRY, delay, stored_error(outcome.error))
    error = stored_error(outcome.error)
    asked = bounded_retry_after(outcome.retry_after, policy.max_delay)
    if not outcome.counts_attempt or (target_down and outcome.retryable):
        return Decision(Verdict.HAND_BACK, max(asked, outage_delay), error)
    if not outcome.retryable or attempt >= policy.max_attempts:
        return Decision(Verdict.DEAD, 0.0, error)
    return Decision(Verdict.RETRY, max(retry_delay(attempt, policy), asked), error)


def retry_delay(attempt: int, policy: RetryPolicy) -> float:
    """Seconds before the retry of a failed ``attempt``: the schedule's, or full jitter."""
    if policy.delays:
        return policy.delays[min(attempt, len(policy.delays)) - 1]
    return full_jitter(attempt, base=policy.base, cap=policy.cap)


def outage(outcomes: Sequence[Outcome], *, target_down: bool) -> bool | None:
    """Whether a batch's outcomes say the target is out (True), back (False) or neither (None).

    Back: something succeeded. Out: nothing did, and the target is reported down or some
    items were never judged. The caller paces an outage (its backoff grows) and, once the
    target is back, makes what it handed back due at once.
    """
    if any(o.ok for o in outcomes):
        return False
    judged = [o for o in outcomes if not isinstance(o, Reschedule)]
    if not judged:
        return None
    if target_down or any(not o.counts_attempt for o in judged):
        return True
    return None
