"""The relay against real PostgreSQL and real brokers: delivery, retries, contention."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from outboxkit import Event, Outbox, Relay, SchemaError
from outboxkit.backends.postgres.postgres import Statements
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.publishers.nats import NatsPublisher
from tests.support.relaying import count, make_events, rows, running_relay, wait_for, write_events
from tests.support.servers import consume_kafka, consume_nats, ensure_stream


def _topic(prefix: str = "orders") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# -- end to end ---------------------------------------------------------------------


async def test_committed_events_arrive_at_kafka_with_key_headers_and_payload_bytes(
    db_dsn: str, kafka_broker: Any
) -> None:
    topic = _topic()
    events = make_events(topic, 40)
    write_events(db_dsn, events)
    async with running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url)):
        await wait_for(lambda: count(db_dsn) == 0, what="outbox drained")
    messages = await asyncio.to_thread(consume_kafka, kafka_broker.bootstrap, topic, 40, 20.0)
    by_id = {dict(m.headers())["idempotency-key"].decode(): m for m in messages}
    assert len(by_id) == 40
    for e in events:
        m = by_id[str(e.event_id)]
        headers = {k: v.decode() for k, v in m.headers()}
        assert m.key() == e.key.encode()  # type: ignore[union-attr]
        assert m.value() == e.payload
        assert headers["ce_id"] == str(e.event_id)
        assert headers["ce_type"] == "order.placed"
        assert headers["ce_specversion"] == "1.0"
        assert headers["ce_subject"] == e.aggregate_id
        assert headers["tenant"] == "acme"
        assert headers["traceparent"] == e.headers["traceparent"]
    # per-key order is kept in the unordered mode when nothing fails
    for key in {e.key for e in events}:
        in_kafka = [m for m in messages if m.key() == key.encode()]  # type: ignore[union-attr]
        offsets = [m.offset() for m in in_kafka]
        ids = [dict(m.headers())["idempotency-key"].decode() for m in in_kafka]
        assert ids == [str(e.event_id) for e in events if e.key == key]
        assert offsets == sorted(offsets)


async def test_committed_events_arrive_at_nats_jetstream_with_msg_id_and_payload_bytes(
    db_dsn: str, nats_server: Any
) -> None:
    subject_root = f"shop{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, subject_root.upper(), [f"{subject_root}.>"])
    events = make_events(f"{subject_root}.orders", 30)
    write_events(db_dsn, events)
    async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url)):
        await wait_for(lambda: count(db_dsn) == 0, what="outbox drained")
    msgs = await consume_nats(nats_server.url, subject_root.upper(), f"{subject_root}.>", 30, 20.0)
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == [str(e.event_id) for e in events]
    for m, e in zip(msgs, events, strict=True):
        assert m.data == e.payload
        assert m.subject == e.topic
        assert m.headers["ce-type"] == "order.placed"
        assert m.headers["tenant"] == "acme"


# -- contention ---------------------------------------------------------------------


def test_concurrent_claims_never_return_the_same_row(db_dsn: str) -> None:
    n = 4000
    write_events(db_dsn, make_events("contention", n))
    claim = Statements().claim_batch
    claimed: list[list[int]] = []
    lock = threading.Lock()
    start = threading.Barrier(6)

    def claimer() -> None:
        mine: list[int] = []
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            start.wait()
            while True:
                params = {
                    "lease": 30.0,
                    "token": uuid.uuid4(),
                    "relay_id": "t",
                    "limit": 37,
                    "max_attempts": 10,
                    "commit": None,
                }
                got = conn.execute(claim, params).fetchall()
                if not got:
                    break
                mine.extend(r[0] for r in got)
        with lock:
            claimed.append(mine)

    threads = [threading.Thread(target=claimer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    every = [i for mine in claimed for i in mine]
    assert len(every) == n, "every row claimed"
    assert len(set(every)) == n, "no row claimed twice while its lease holds"
    assert sum(1 for mine in claimed if mine) > 1, "the work was actually shared"
    assert count(db_dsn, "attempts = 1 AND claim_token IS NOT NULL") == n


async def test_several_relays_on_one_table_publish_each_event_exactly_once(
    db_dsn: str, kafka_broker: Any
) -> None:
    topic = _topic()
    n = 3000
    write_events(db_dsn, make_events(topic, n, keys=100))
    async with (
        running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url), batch_size=100) as a,
        running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url), batch_size=100) as b,
        running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url), batch_size=100) as c,
    ):
        await wait_for(lambda: count(db_dsn) == 0, timeout=60, what="outbox drained")
    assert a.stats.published + b.stats.published + c.stats.published == n
    assert sum(1 for r in (a, b, c) if r.stats.published) >= 2
    messages = await asyncio.to_thread(consume_kafka, kafka_broker.bootstrap, topic, n, 30.0)
    ids = [dict(m.headers())["idempotency-key"] for m in messages]
    assert len(ids) == n
    assert len(set(ids)) == n


# -- failures -----------------------------------------------------------------------


async def test_publish_failure_is_recorded_retried_then_dead_lettered_and_later_events_flow(
    db_dsn: str, fresh_nats: Any
) -> None:
    """A message the broker refuses each time (no stream stores its subject) is retried with
    its attempts counted, then dead-lettered; it never blocks later events. (A broker that
    is down refuses nothing: that is an outage, handed back without counting, see
    test_outage_attempts.py.)"""
    await ensure_stream(fresh_nats.url, "SHOP", ["shop.>"])
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, state text)")
    poison = Event(topic="unstored.orders", event_type="order.placed", payload={"id": 1})
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        conn.execute("INSERT INTO orders VALUES (1, 'placed')")
        Outbox().put(conn, poison)
    publisher = NatsPublisher.from_url(fresh_nats.url + "?timeout=0.3")
    async with running_relay(
        db_dsn, publisher, max_attempts=3, retry_base=1.5, retry_cap=1.5
    ) as relay:
        await wait_for(lambda: count(db_dsn, "attempts >= 1 AND last_error IS NOT NULL") == 1)
        [row] = rows(db_dsn)
        assert row["status"] == 0, "a transient failure is retried, not dead-lettered"
        assert "no JetStream stream stores subject" in row["last_error"]
        await wait_for(lambda: count(db_dsn, "status = 2") == 1, what="dead-lettered")
        [row] = rows(db_dsn)
        assert row["attempts"] == 3
        assert row["last_error"]
        # The stats follow the settle's commit (the observer hears of it once it returns).
        await wait_for(lambda: relay.stats.dead_lettered == 1, what="the dead letter counted")
        assert relay.stats.retried == 2
        # later events flow, the dead letter stays put
        later = Event(topic="shop.orders", event_type="order.paid", payload={"id": 1})
        write_events(db_dsn, [later])
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, timeout=30, what="later event")
    assert count(db_dsn, "status = 2") == 1
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("SELECT state FROM orders").fetchall() == [("placed",)]
    msgs = await consume_nats(fresh_nats.url, "SHOP", "shop.>", 1, 10.0)
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == [str(later.event_id)]


async def test_a_message_the_broker_will_never_accept_is_dead_lettered_at_once(
    db_dsn: str, kafka_broker: Any
) -> None:
    good_topic = _topic()
    good = make_events(good_topic, 3)
    bad = Event(topic="not-a-valid-topic!", event_type="x", payload={})  # Kafka: [A-Za-z0-9._-]
    write_events(db_dsn, [good[0], bad, *good[1:]])
    async with running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url), max_attempts=10):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="settled")
    [row] = rows(db_dsn)
    assert row["event_id"] == bad.event_id
    assert (row["status"], row["attempts"]) == (2, 1)
    assert "topic" in row["last_error"].lower()
    messages = await asyncio.to_thread(consume_kafka, kafka_broker.bootstrap, good_topic, 3, 20.0)
    assert len(messages) == 3


# -- wake-up, retention, schema -------------------------------------------------------


async def test_an_idle_relay_publishes_a_new_event_well_before_its_poll_interval(
    db_dsn: str, kafka_broker: Any
) -> None:
    topic = _topic()
    async with running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url), poll_interval=30):
        await asyncio.sleep(1.0)  # idle: LISTENing, next poll 30 s away
        start = time.monotonic()
        write_events(db_dsn, make_events(topic, 1))
        await wait_for(lambda: count(db_dsn) == 0, timeout=10, interval=0.01, what="NOTIFY")
        woke_after = time.monotonic() - start
    assert woke_after < 3.0, f"took {woke_after:.2f}s: the relay waited for its poll"


async def test_without_notify_an_idle_relay_waits_for_its_poll(
    db_dsn: str, kafka_broker: Any
) -> None:
    topic = _topic()
    async with running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url), poll_interval=30):
        await asyncio.sleep(1.0)
        write_events(db_dsn, make_events(topic, 1), outbox=Outbox(notify=False))
        await asyncio.sleep(2.0)
        assert count(db_dsn) == 1, "no NOTIFY, no wake-up: the poll is the fallback"


async def test_keep_retention_marks_rows_published_instead_of_deleting(
    db_dsn: str, kafka_broker: Any
) -> None:
    write_events(db_dsn, make_events(_topic(), 10))
    async with running_relay(
        db_dsn, KafkaPublisher.from_url(kafka_broker.url), retention="keep"
    ) as relay:
        await wait_for(lambda: count(db_dsn, "status = 1") == 10, what="published")
    assert relay.stats.published == 10
    assert count(db_dsn, "published_at IS NOT NULL AND claim_token IS NULL") == 10


async def test_a_relay_on_a_database_without_the_table_says_to_migrate(
    empty_db_dsn: str, kafka_broker: Any
) -> None:
    relay = Relay(empty_db_dsn, KafkaPublisher.from_url(kafka_broker.url), listen=False)
    with pytest.raises(SchemaError, match="outboxkit migrate"):
        await asyncio.wait_for(relay.run(), timeout=20)


@pytest.mark.exclusive  # drives the CPUs itself: alone under xdist
def test_claim_uses_the_pending_index_with_a_million_published_rows(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (event_id, topic, event_type, payload, status, published_at)"
            " SELECT gen_random_uuid(), 't', 'x', '\\x00', 1, now()"
            " FROM generate_series(1, 1000000)"
        )
        conn.execute(
            "INSERT INTO outbox (event_id, topic, event_type, payload)"
            " SELECT gen_random_uuid(), 't', 'x', '\\x00' FROM generate_series(1, 1000)"
        )
        conn.execute("ANALYZE outbox")
        claim = Statements().claim_batch
        params = {
            "lease": 30.0,
            "token": uuid.uuid4(),
            "relay_id": "plan",
            "limit": 500,
            "max_attempts": 10,
            "commit": None,
        }
        with conn.transaction():
            plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + claim, params).fetchone()
            raise psycopg.Rollback()  # EXPLAIN ANALYZE ran the claim: undo it
        assert plan is not None
        text = str(plan[0])
        assert "outbox_pending_idx" in text
        assert "Seq Scan" not in text
        assert "'Node Type': 'Sort'" not in text, "the index order serves ORDER BY"


def test_claim_never_scans_the_table_while_a_backlog_drains(db_dsn: str) -> None:
    """With `IN (SELECT ...)` the planner hash-joined the locked ids against a sequential
    scan of the whole table once it was small enough; the claim must stay on the indexes."""
    claim = Statements().claim_batch
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (event_id, topic, event_type, payload)"
            " SELECT gen_random_uuid(), 't', 'x', convert_to(repeat('x', 300), 'UTF8')"
            " FROM generate_series(1, 20000)"
        )
        conn.execute("VACUUM ANALYZE outbox")
        for limit in (500, 1000):
            params = {
                "lease": 30.0,
                "token": uuid.uuid4(),
                "relay_id": "plan",
                "limit": limit,
                "max_attempts": 10,
                "commit": "off",
            }
            with conn.transaction():
                plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + claim, params).fetchone()
                raise psycopg.Rollback()
            assert plan is not None
            text = str(plan[0])
            assert "Seq Scan" not in text, text
            assert "Hash" not in text, text
            assert "outbox_pkey" in text and "outbox_pending_idx" in text


def test_relay_statements_commit_asynchronously_without_changing_the_session(
    db_dsn: str,
) -> None:
    """The relay's claim and settle set synchronous_commit for their own transaction only."""
    write_events(db_dsn, make_events("async-commit", 10))
    sql = Statements()
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")  # the test server may run with it off
        token = uuid.uuid4()
        params = {
            "lease": 30.0,
            "token": token,
            "relay_id": "t",
            "limit": 5,
            "commit": "off",
            "max_attempts": 10,
        }
        claimed = conn.execute(sql.claim_batch, params).fetchall()
        assert len(claimed) == 5
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        # Inside one transaction the setting is visible, and it is gone after it.
        with conn.transaction():
            ids = [r[0] for r in claimed]
            done = conn.execute(sql.settle_published_delete, (ids, token, "off"))
            assert done.rowcount == 5
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        # None keeps whatever the session has (the relay's synchronous_commit=True).
        conn.execute("SET synchronous_commit = remote_apply")
        with conn.transaction():
            params = {**params, "token": uuid.uuid4(), "commit": None}
            assert len(conn.execute(sql.claim_batch, params).fetchall()) == 5
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("remote_apply",)
    assert count(db_dsn) == 5
