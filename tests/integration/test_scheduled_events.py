"""Scheduled events: Event(deliver_at=...) / Event(delay=...) reach the broker no earlier
than their time, and within the relay's poll_interval after it; a write whose events are
all in the future sends no NOTIFY (it would wake every relay for nothing).

Checked from the broker's side: JetStream stamps each message when it stores it, on the
same machine's clock as PostgreSQL's now() and the test's datetime.now().
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.postgres import Statements, channel_for
from outboxkit.publishers.nats import NatsPublisher
from tests.support.relaying import running_relay, wait_for
from tests.support.servers import consume_nats, ensure_stream

POLL = 0.5
DELAY = dt.timedelta(seconds=2.5)
# Past the poll interval: the claim, the publish and a busy 2-core machine.
SLACK = dt.timedelta(seconds=POLL + 1.5)


def _event(topic: str, key: str | None = None, **kwargs: Any) -> Event:
    return Event(topic=topic, event_type="reminder.due", payload={"n": 1}, key=key, **kwargs)


def _put(dsn: str, ob: Outbox, events: list[Event]) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for e in events:
            ob.put(conn, e)


def _put_many(dsn: str, ob: Outbox, events: list[Event]) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        ob.put_many(conn, events)


def _execute_with(dsn: str, ob: Outbox, events: list[Event]) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        ob.execute_with(conn, "SELECT %s::int", (1,), events=events)


def _transaction(dsn: str, ob: Outbox, events: list[Event]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, ob.transaction(conn) as tx:
        tx.put_many(events)


Writer = Callable[[str, Outbox, list[Event]], None]
PATHS: dict[str, Writer] = {
    "put": _put,
    "put_many": _put_many,
    "execute_with": _execute_with,
    "transaction": _transaction,
}


def _stored_at(msg: Any) -> dt.datetime:
    stamp: dt.datetime = msg.metadata.timestamp
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)


async def test_scheduled_events_are_published_at_their_time_not_before(
    db_dsn: str, nats_server: Any
) -> None:
    root = f"sched{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    outbox = Outbox()
    now = dt.datetime.now(dt.UTC)
    scheduled: dict[uuid.UUID, dt.datetime] = {}
    immediate: list[Event] = []
    for i, (name, write) in enumerate(PATHS.items()):
        topic = f"{root}.{name.replace('_', '-')}"
        later = _event(topic, deliver_at=now + DELAY + dt.timedelta(seconds=0.5 * i))
        soon = _event(topic, delay=DELAY)
        assert later.available_at is not None and soon.available_at is not None
        scheduled[later.event_id] = later.available_at
        scheduled[soon.event_id] = soon.available_at
        at_once = _event(topic)
        immediate.append(at_once)
        write(db_dsn, outbox, [later, at_once, soon])
    total = len(scheduled) + len(immediate)
    async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url), poll_interval=POLL):
        msgs = await consume_nats(nats_server.url, root.upper(), f"{root}.>", total, 30.0)
    assert len(msgs) == total
    by_id = {uuid.UUID(m.headers["Nats-Msg-Id"]): m for m in msgs}
    first_scheduled = min(scheduled.values())
    for event in immediate:
        assert _stored_at(by_id[event.event_id]) < first_scheduled  # not held back
    for event_id, at in scheduled.items():
        stored = _stored_at(by_id[event_id])
        assert at <= stored, f"published {at - stored} early"
        assert stored <= at + SLACK, f"published {stored - at} after its time"


async def test_an_event_scheduled_later_than_the_test_stays_in_the_outbox(
    db_dsn: str, nats_server: Any
) -> None:
    root = f"sched{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    later = _event(f"{root}.x", delay=dt.timedelta(hours=1))
    now = _event(f"{root}.x")
    _put_many(db_dsn, Outbox(), [later, now])
    publisher = NatsPublisher.from_url(nats_server.url)
    async with running_relay(db_dsn, publisher, poll_interval=0.1) as relay:
        await wait_for(lambda: relay.stats.published >= 1, what="the due event published")
        await asyncio.sleep(1.0)  # ten polls
        assert relay.stats.published == 1
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute(
            "SELECT status, attempts, available_at > now() + interval '50 minutes'"
            " FROM outbox WHERE event_id = %s",
            (later.event_id,),
        ).fetchone()
    assert row == (0, 0, True)  # pending, never claimed, still scheduled


@pytest.mark.parametrize("ordered", [True, False])
async def test_under_an_ordered_relay_a_scheduled_head_holds_back_its_key_only(
    db_dsn: str, nats_server: Any, ordered: bool
) -> None:
    """Order wins: the key's next event waits for the scheduled one; other keys do not.

    The unordered relay (the contrast) publishes the key's next event at once, ahead
    of the scheduled one written before it."""
    migrate(db_dsn, ordered=True, partitions=4)
    root = f"sched{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    topic = f"{root}.x"
    outbox = Outbox(ordered=True)
    head = _event(topic, key="k", delay=DELAY)
    assert head.available_at is not None
    follower = _event(topic, key="k")
    others = [_event(topic, key="other"), _event(topic)]
    _put(db_dsn, outbox, [head])
    _put_many(db_dsn, outbox, [follower, *others])
    publisher = NatsPublisher.from_url(nats_server.url)
    async with running_relay(db_dsn, publisher, poll_interval=POLL, ordered=ordered):
        msgs = await consume_nats(nats_server.url, root.upper(), f"{root}.>", 4, 30.0)
    ids = [uuid.UUID(m.headers["Nats-Msg-Id"]) for m in msgs]
    stored = dict(zip(ids, (_stored_at(m) for m in msgs), strict=True))
    assert head.available_at <= stored[head.event_id] <= head.available_at + SLACK
    if not ordered:
        assert stored[follower.event_id] < head.available_at  # the key's order is lost
        return
    assert ids.index(head.event_id) < ids.index(follower.event_id)
    assert stored[follower.event_id] >= head.available_at
    for event in others:
        assert stored[event.event_id] < head.available_at  # not held back


# -- NOTIFY only when something is due --------------------------------------------------


def _notified(dsn: str, write: Callable[[], None], timeout: float = 3.0) -> bool:
    """Whether the write woke a listener. A notify arrives as its COMMIT returns; the wait
    is long only for a loaded machine (its absence is asserted with a shorter one)."""
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {channel_for('outbox')}")
        # Waits for work, as a relay does: holding the wake-up lock. The previous call's
        # listener may still hold it for a moment after its connection closed (its server
        # process ends a little later on a loaded machine): try again, as the relay does.
        deadline = time.monotonic() + 10
        while not listener.execute(Statements("outbox").try_wake_lock).fetchone()[0]:
            assert time.monotonic() < deadline, "the wake-up lock stayed taken"
            time.sleep(0.01)
        write()
        return any(True for _ in listener.notifies(timeout=timeout, stop_after=1))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("ordered", [False, True])
def test_a_write_of_only_future_events_sends_no_notify(
    db_dsn: str, path: str, ordered: bool
) -> None:
    outbox = Outbox(ordered=ordered)
    write = PATHS[path]
    future = [_event("t", key="k", delay=dt.timedelta(minutes=5)), _event("t", delay=DELAY)]
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    assert not _notified(db_dsn, lambda: write(db_dsn, outbox, future), timeout=0.5)
    # one due event among them is enough, also one whose time has passed
    mixed = [_event("t", delay=DELAY), _event("t", key="k", deliver_at=past)]
    assert _notified(db_dsn, lambda: write(db_dsn, outbox, mixed))
    assert _notified(db_dsn, lambda: write(db_dsn, outbox, [_event("t", key="k")]))
    with psycopg.connect(db_dsn) as conn:
        stored = conn.execute("SELECT count(*) FROM outbox WHERE available_at > now()").fetchone()
    assert stored == (3,)


def test_available_at_is_stored_as_given_and_defaults_to_the_transaction_time(
    db_dsn: str,
) -> None:
    at = dt.datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    events = [_event("t", deliver_at=at), _event("t")]
    for write in PATHS.values():
        write(db_dsn, Outbox(), events[:1])
        write(db_dsn, Outbox(), events[1:])  # alone: the unscheduled statement path
        events = [_event("t", deliver_at=at), _event("t")]
    with psycopg.connect(db_dsn) as conn:
        rows = conn.execute(
            "SELECT available_at, available_at = created_at FROM outbox ORDER BY id"
        ).fetchall()
    assert [r[0] for r in rows[0::2]] == [at] * len(PATHS)
    assert all(same for _, same in rows[1::2])  # now(), as the column's default
