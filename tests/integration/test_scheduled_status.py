"""A scheduled event is pending, but not late: the oldest-pending age ignores it until its time.

Without this, one event scheduled for tomorrow made `outboxkit status`, the dashboard
and the OutboxPendingTooOld alert report a backlog stuck since it was written, while
an event handed back during a broker outage must keep counting from its write.
"""

from __future__ import annotations

import datetime as dt

import psycopg

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.admin import live_status, status


def _write(dsn: str, *events: Event) -> None:
    outbox = Outbox(notify=False)
    with psycopg.connect(dsn) as conn, conn.transaction():
        outbox.put_many(conn, events)


def _age(dsn: str) -> tuple[float | None, float | None]:
    return status(dsn).oldest_pending_age_s, live_status(dsn).status.oldest_pending_age_s


def test_a_future_event_is_pending_but_sets_no_age(db_dsn: str) -> None:
    _write(
        db_dsn,
        Event(topic="orders", event_type="order.remind", payload={}, delay=dt.timedelta(hours=1)),
    )
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # written an hour ago
        conn.execute("UPDATE outbox SET created_at = now() - interval '1 hour'")
    assert status(db_dsn).pending == 1
    for age in _age(db_dsn):
        assert age is None or age == 0.0


def test_a_due_event_is_aged_from_its_time_not_its_write(db_dsn: str) -> None:
    _write(db_dsn, Event(topic="orders", event_type="order.remind", payload={}))
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        # written an hour ago, due a second ago (as if scheduled 59m59s ahead)
        conn.execute(
            "UPDATE outbox SET created_at = now() - interval '1 hour',"
            " available_at = now() - interval '1 second'"
        )
    for age in _age(db_dsn):
        assert age is not None and 0.5 < age < 60


def test_an_event_handed_back_in_an_outage_keeps_its_age(db_dsn: str) -> None:
    _write(db_dsn, Event(topic="orders", event_type="order.placed", payload={}))
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        # what the relay's settle leaves for a row handed back untried: attempt refunded,
        # a future retry time, and the broker's error
        conn.execute(
            "UPDATE outbox SET created_at = now() - interval '1 hour',"
            " available_at = now() + interval '30 seconds', attempts = 0,"
            " last_error = 'broker unreachable'"
        )
    for age in _age(db_dsn):
        assert age is not None and age > 3500
