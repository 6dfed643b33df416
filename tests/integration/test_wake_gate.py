"""The wake-up gate: writers NOTIFY only while a relay waits for work (issue 14).

A NOTIFY makes its commit take a database-wide lock held through the WAL flush, so
notifying commits go one at a time. A waiting relay holds the channel's advisory lock;
writers notify only then, and a relay can take the lock only once every writer that
skipped the NOTIFY has committed (its next claim sees their rows).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.postgres import Statements
from tests.support.relaying import TimingPublisher, running_relay

SQL = Statements("outbox")


def _event() -> Event:
    return Event(topic="t", event_type="x", payload={"n": 1}, key="k")


def _notified(listener: psycopg.Connection[Any]) -> int:
    return sum(1 for _ in listener.notifies(timeout=0.3, stop_after=10))


def _write_all_ways(dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            outbox.put(conn, _event())
        with conn.transaction():
            outbox.put_many(conn, [_event(), _event()])
        with conn.transaction():
            outbox.execute_with(conn, "SELECT 1", events=[_event()])
    with psycopg.connect(dsn, autocommit=True) as conn, outbox.transaction(conn) as tx:
        tx.put(_event())


def test_writers_notify_only_while_a_relay_holds_the_gate(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "{SQL.channel}"')
        _write_all_ways(db_dsn)
        assert _notified(listener) == 0, "nobody waits: no NOTIFY, no commit-time lock"
        with psycopg.connect(db_dsn, autocommit=True) as relay:
            assert relay.execute(SQL.try_wake_lock).fetchone() == (True,)
            _write_all_ways(db_dsn)
            assert _notified(listener) == 4, "one per transaction while a relay waits"
            relay.execute(SQL.wake_unlock)
        _write_all_ways(db_dsn)
        assert _notified(listener) == 0


def test_a_relay_takes_the_gate_only_after_writers_that_skipped_the_notify_commit(
    db_dsn: str,
) -> None:
    """The naive gate (a flag read by writers) loses the wake-up of a writer that read
    'relay busy' and commits after the relay's last look; the lock waits for it."""
    with psycopg.connect(db_dsn) as writer, psycopg.connect(db_dsn, autocommit=True) as relay:
        with writer.transaction():
            Outbox().put(writer, _event())  # no relay waiting: no NOTIFY, gate held open
            assert relay.execute(SQL.try_wake_lock).fetchone() == (False,)
        # Committed: the relay takes the gate, and its claim sees the row.
        assert relay.execute(SQL.try_wake_lock).fetchone() == (True,)
        row = relay.execute("SELECT count(*) FROM outbox WHERE status = 0").fetchone()
        assert row == (1,)


async def test_a_lingering_relay_is_not_notified_and_an_idle_one_is(db_dsn: str) -> None:
    publisher = TimingPublisher()
    with psycopg.connect(db_dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "{SQL.channel}"')
        async with running_relay(db_dsn, publisher, poll_interval=30, linger=2.0):
            await asyncio.sleep(0.5)  # idle: holds the gate, LISTENing, next poll 30 s away
            first = _event()
            written = time.monotonic()
            await asyncio.to_thread(_write, db_dsn, first)
            await _published(publisher, first)
            assert publisher.at[first.event_id] - written < 3.0, "woken by the NOTIFY"
            assert await asyncio.to_thread(_notified, listener) == 1
            # Lingering for 2 s after that batch: writers skip the NOTIFY, and the relay
            # still picks their events up within milliseconds.
            second = _event()
            written = time.monotonic()
            await asyncio.to_thread(_write, db_dsn, second)
            await _published(publisher, second)
            assert publisher.at[second.event_id] - written < 1.0
            assert await asyncio.to_thread(_notified, listener) == 0


def _write(dsn: str, event: Event) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, Outbox().transaction(conn) as tx:
        tx.put(event)


async def _published(publisher: TimingPublisher, event: Event, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while event.event_id not in publisher.at:
        assert time.monotonic() < deadline, "not published"
        await asyncio.sleep(0.005)
