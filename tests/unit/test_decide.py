"""decide(): the one retry / dead-letter decision (outboxkit.queue.decide), no server."""

from __future__ import annotations

import random

import pytest

from outboxkit.publishers.base import PublishResult
from outboxkit.queue.decide import MAX_ERROR_CHARS, RetryPolicy, decide, outage
from outboxkit.queue.store import DONE, Verdict

POLICY = RetryPolicy(max_attempts=3, base=1.0, cap=300.0)


def test_a_success_is_done() -> None:
    assert decide(1, PublishResult.success(), POLICY) is DONE


def test_a_retryable_failure_retries_after_a_full_jitter_delay() -> None:
    random.seed(7)
    delays = []
    for _ in range(200):
        d = decide(3 - 1, PublishResult.retry("busy"), POLICY)
        assert d.verdict is Verdict.RETRY
        assert d.error == "busy"
        delays.append(d.delay)
    assert min(delays) >= 0.0
    assert max(delays) <= 2.0  # base * 2^(attempt-1)
    assert max(delays) > 1.0  # full jitter: spread over the whole range


def test_the_last_attempt_dead_letters() -> None:
    d = decide(3, PublishResult.retry("busy"), POLICY)
    assert (d.verdict, d.delay, d.error) == (Verdict.DEAD, 0.0, "busy")


def test_a_permanent_rejection_dead_letters_at_the_first_attempt() -> None:
    d = decide(1, PublishResult.permanent("too large", "MessageTooLarge"), POLICY)
    assert d.verdict is Verdict.DEAD


def test_retry_after_is_honoured_and_bounded() -> None:
    d = decide(1, PublishResult.retry("slow down", retry_after=120.0), POLICY)
    assert (d.verdict, d.delay) == (Verdict.RETRY, 120.0)
    huge = decide(1, PublishResult.retry("x", retry_after=1e20), POLICY)
    assert huge.delay == POLICY.max_delay
    nan = decide(1, PublishResult.retry("x", retry_after=float("nan")), RetryPolicy(cap=0.0))
    assert nan.delay == 0.0


def test_an_untried_item_is_handed_back_even_on_its_last_attempt() -> None:
    """Never judged: the attempt is refunded, whatever the count (an outage is not its fault)."""
    d = decide(3, PublishResult.hand_back("ConnectionError: refused"), POLICY, outage_delay=4.0)
    assert (d.verdict, d.delay) == (Verdict.HAND_BACK, 4.0)


def test_a_retryable_failure_while_the_target_is_down_is_handed_back() -> None:
    d = decide(3, PublishResult.retry("no PubAck"), POLICY, target_down=True)
    assert d.verdict is Verdict.HAND_BACK
    # ... but a rejection is still the message's own fault
    r = decide(1, PublishResult.permanent("bad subject"), POLICY, target_down=True)
    assert r.verdict is Verdict.DEAD


def test_the_stored_error_is_redacted_and_bounded() -> None:
    d = decide(1, PublishResult.retry("amqp://app:s3cret@mq:5672 refused " + "x" * 5000), POLICY)
    assert d.error is not None and "s3cret" not in d.error
    assert len(d.error) == MAX_ERROR_CHARS
    assert decide(1, PublishResult(ok=False), POLICY).error == "unknown error"


@pytest.mark.parametrize(
    ("results", "down", "expected"),
    [
        ([PublishResult.success(), PublishResult.retry("x")], True, False),
        ([PublishResult.retry("x")], True, True),
        ([PublishResult.hand_back("x"), PublishResult.retry("y")], False, True),
        ([PublishResult.retry("x")], False, None),
        ([], False, None),
    ],
)
def test_a_batch_tells_an_outage_from_a_recovery(
    results: list[PublishResult], down: bool, expected: bool | None
) -> None:
    assert outage(results, target_down=down) is expected
