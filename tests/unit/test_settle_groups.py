"""group_decisions(): a claim's decisions split into what each settle writes (no server)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

from outboxkit.queue.settle import UNKNOWN_ERROR, group_decisions
from outboxkit.queue.store import DONE, Claim, Decision, Verdict


@dataclass(frozen=True)
class _Item:
    attempt: int = 1


def _claim(*ids: int) -> Claim[_Item]:
    return Claim(uuid.uuid4(), list(ids), [_Item() for _ in ids])


def test_every_verdict_lands_in_its_column_in_claim_order() -> None:
    decisions = [
        DONE,
        Decision(Verdict.RETRY, 2.5, "busy"),
        Decision(Verdict.DEAD, 0.0, "too large"),
        DONE,
        Decision(Verdict.HAND_BACK, 1.0, "broker down"),
    ]
    groups = group_decisions(_claim(10, 11, 12, 13, 14), decisions)
    assert groups.done == [10, 13]
    assert groups.failed == [11, 12, 14]
    assert groups.dead == [False, True, False]
    assert groups.delays == [2.5, 0.0, 1.0]
    assert groups.errors == ["busy", "too large", "broker down"]
    assert groups.refund == [False, False, True]  # only a hand-back refunds its attempt
    assert groups.failures() == [
        (11, False, 2.5, "busy", False),
        (12, True, 0.0, "too large", False),
        (14, False, 1.0, "broker down", True),
    ]


def test_a_failure_without_an_error_is_stored_as_unknown() -> None:
    groups = group_decisions(_claim(1), [Decision(Verdict.RETRY, 1.0)])
    assert groups.errors == [UNKNOWN_ERROR]


def test_all_done_leaves_no_failures() -> None:
    groups = group_decisions(_claim(1, 2, 3), [DONE] * 3)
    assert groups.done == [1, 2, 3]
    assert groups.failed == [] and groups.failures() == []


def test_a_decision_count_that_differs_from_the_claim_is_refused() -> None:
    # Pairing an id with its neighbour's decision would settle the wrong event.
    with pytest.raises(ValueError):
        group_decisions(_claim(1, 2), [DONE])
