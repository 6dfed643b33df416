"""The relay's observer hooks: fan-out, a failing hook isolated, stats counted from hooks."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime

import psycopg
import pytest
from psycopg import errors as pg_errors

from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.sink.observer import Observers, RelayObserver, RelayStats, StatsObserver


def _message() -> OutboundMessage:
    now = datetime.now(UTC)
    return OutboundMessage(
        uuid.uuid4(), "orders", None, "order.placed", None, None, b"{}", {}, now, 1, now, 1
    )


class _Raising(RelayObserver):
    def handed_back(self, count: int, error: str | None) -> None:
        raise RuntimeError("observer bug")

    def lost_leases(self, count: int) -> None:
        raise RuntimeError("observer bug")

    def database_error(self, operation: str, error: Exception, connection_lost: bool) -> None:
        raise RuntimeError("observer bug")


def test_every_hook_reaches_the_stats_past_an_observer_that_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stats = RelayStats()
    observers = Observers(_Raising(), StatsObserver(stats))
    retry = PublishResult.retry("broker said later", "Busy")
    with caplog.at_level(logging.ERROR, "outboxkit.relay"):
        observers.claimed(3, 0.001)
        observers.claimed(0, 0.001)  # an idle claim is not a batch
        observers.settled([_message()], [(_message(), retry)], ())
        observers.handed_back(2, "ConnectionError: refused")
        observers.lost_leases(4)
        observers.database_error("claim", psycopg.OperationalError("gone"), True)
        observers.database_error("settle", pg_errors.RaiseException("refused"), False)
    assert (stats.claimed, stats.batches, stats.published, stats.retried) == (3, 1, 1, 1)
    assert (stats.released, stats.lease_lost) == (2, 4)
    assert (stats.db_reconnects, stats.db_errors) == (1, 1)
    assert stats.last_error == "ConnectionError: refused"
    assert sum("observer bug" in (r.exc_text or "") for r in caplog.records) == 4


def test_an_observer_overriding_a_renamed_hook_is_refused_not_skipped() -> None:
    """publishing/published became the queue core's processing/processed (the task worker
    shares them): an override of the old name would never be called, so it fails loudly."""
    with pytest.raises(TypeError, match=r"RelayObserver\.published, renamed processed"):

        class _Old(RelayObserver):
            def published(self, *args: object) -> None: ...

    class _New(RelayObserver):
        published = 0  # not a hook: an attribute of its own is left alone

        def processed(self, *args: object) -> None:
            self.published += 1

    observer = _New()
    Observers(observer).processed([_message()], [PublishResult.success()], 0.0)
    assert observer.published == 1
