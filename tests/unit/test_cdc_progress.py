"""The CDC relay's confirm rule (outboxkit.cdc.progress): only positions all of whose events
the broker confirmed, transactions spanning batches, keepalives between transactions only."""

from __future__ import annotations

import pytest

from outboxkit.cdc.progress import Progress


def _transaction(p: Progress, events: int, end_lsn: int) -> list[int]:
    p.begin()
    seqs = [p.event() for _ in range(events)]
    p.commit(end_lsn)
    return seqs


def test_a_transaction_is_confirmable_only_once_all_its_events_are_settled() -> None:
    p = Progress()
    _transaction(p, 3, 100)
    _transaction(p, 2, 200)
    p.settle(2)  # the first transaction's third event is still out
    assert p.confirmable() is None
    p.settle(4)  # the first done, the second half done
    assert p.confirmable() == 100
    assert p.confirmable() is None  # not twice
    p.settle(5)
    assert p.confirmable() == 200
    assert p.confirmed == 200


def test_a_transaction_streamed_across_batches_is_not_confirmed_before_its_commit() -> None:
    p = Progress()
    p.begin()
    for _ in range(5):
        p.event()
    p.settle(5)  # every event received so far is published, the commit has not arrived
    p.keepalive(500)  # inside a transaction: the rest of it lies before this position
    assert p.confirmable() is None
    p.commit(600)
    assert p.confirmable() == 600


def test_an_idle_stream_advances_to_each_keepalive() -> None:
    p = Progress(confirmed=50)
    p.keepalive(40)  # behind the slot's position: nothing to do
    assert p.confirmable() is None
    p.keepalive(100)
    p.keepalive(300)  # nothing received in between: one marker moved forward
    assert p.confirmable() == 300
    assert p.idle


def test_a_keepalive_after_unsettled_events_waits_for_them() -> None:
    p = Progress()
    _transaction(p, 2, 100)
    p.keepalive(900)
    p.settle(1)
    assert p.confirmable() is None
    p.settle(2)
    assert p.confirmable() == 900


def test_transactions_without_events_are_confirmed_with_the_ones_before_them() -> None:
    p = Progress()
    _transaction(p, 1, 100)
    _transaction(p, 0, 150)  # e.g. only a dead letter's own insert (skipped) or other prefixes
    assert p.confirmable() is None
    p.settle(1)
    assert p.confirmable() == 150


def test_settling_out_of_range_is_a_bug() -> None:
    p = Progress()
    _transaction(p, 1, 100)
    with pytest.raises(ValueError, match="outside"):
        p.settle(2)
