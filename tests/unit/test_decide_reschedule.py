"""decide() for what a task handler asks (Retry, Snooze) and a retry schedule as data; no server."""

from __future__ import annotations

from outboxkit.publishers.base import PublishResult
from outboxkit.queue.decide import Reschedule, RetryPolicy, decide, outage, retry_delay
from outboxkit.queue.store import Verdict

POLICY = RetryPolicy(max_attempts=3, base=1.0, cap=300.0)


def test_a_schedule_as_data_gives_each_retry_its_delay_and_repeats_the_last() -> None:
    policy = RetryPolicy(max_attempts=10, delays=(1.0, 5.0, 30.0))
    assert [retry_delay(n, policy) for n in (1, 2, 3, 4, 9)] == [1.0, 5.0, 30.0, 30.0, 30.0]
    d = decide(2, PublishResult.retry("boom"), policy)
    assert (d.verdict, d.delay) == (Verdict.RETRY, 5.0)


def test_a_reschedule_that_counts_retries_after_exactly_its_delay() -> None:
    d = decide(1, Reschedule(0.25, error="later"), POLICY)
    assert (d.verdict, d.delay, d.error) == (Verdict.RETRY, 0.25, "later")


def test_a_reschedule_that_counts_dead_letters_on_the_last_attempt() -> None:
    d = decide(3, Reschedule(0.25, error="later"), POLICY)
    assert d.verdict is Verdict.DEAD


def test_a_snooze_hands_back_with_the_attempt_refunded_even_on_the_last_attempt() -> None:
    d = decide(3, Reschedule(2.0, counts_attempt=False), POLICY)
    assert (d.verdict, d.delay, d.error) == (Verdict.HAND_BACK, 2.0, None)


def test_a_reschedule_is_never_taken_for_an_outage() -> None:
    snooze = Reschedule(1.0, counts_attempt=False)
    assert outage([snooze, snooze], target_down=False) is None
    assert outage([snooze, PublishResult.hand_back("down")], target_down=False) is True
