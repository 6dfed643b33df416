"""Adversarial tests: the naive way loses events under real faults; the outbox does not.

Faults are real: broker processes stopped, relay processes SIGKILLed, database
backends terminated and servers restarted, connections cut by a proxy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.testing import EmbeddedPostgres, spawn_relay
from tests.support.relaying import (
    count,
    make_events,
    running_relay,
    wait_for,
    write_events,
)
from tests.support.servers import consume_kafka, consume_nats, ensure_stream

pytestmark = pytest.mark.slow


def _kafka_ids(messages: list[Any]) -> list[str]:
    return [dict(m.headers())["idempotency-key"].decode() for m in messages]


async def _publish_naively(url: str, event: Event) -> None:
    nc = await nats.connect(url, connect_timeout=0.5, max_reconnect_attempts=1)
    await nc.jetstream().publish(event.topic, event.payload, timeout=0.5)


async def test_naive_dual_write_loses_the_event_when_publish_fails_after_commit_outbox_does_not(
    db_dsn: str, fresh_nats: Any
) -> None:
    await ensure_stream(fresh_nats.url, "SHOP", ["shop.>"])
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    fresh_nats.stop()  # the broker is down right after our commits

    # Naive: commit the order, then publish. The publish fails; the order stays committed.
    naive_event = Event(topic="shop.naive", event_type="order.placed", payload={"id": 1})
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        conn.execute("INSERT INTO orders VALUES (1)")
    with pytest.raises(Exception):  # any connection error or timeout: the broker is gone
        await asyncio.wait_for(_publish_naively(fresh_nats.url, naive_event), timeout=5)

    # Outbox: the event is written in the order's transaction.
    outbox_event = Event(topic="shop.outbox", event_type="order.placed", payload={"id": 2})
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        conn.execute("INSERT INTO orders VALUES (2)")
        Outbox().put(conn, outbox_event)

    publisher = NatsPublisher.from_url(fresh_nats.url + "?timeout=0.3")
    async with running_relay(db_dsn, publisher, retry_base=0.1, retry_cap=0.3):
        await wait_for(lambda: count(db_dsn, "last_error IS NOT NULL") == 1, what="a failed try")
        fresh_nats.start()
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="outbox drained")

    msgs = await consume_nats(fresh_nats.url, "SHOP", "shop.>", 1, 10.0)
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == [str(outbox_event.event_id)]
    assert count(db_dsn, table="orders") == 2, "both orders committed; only one event survived"


async def test_relay_killed_mid_batch_loses_nothing(
    db_dsn: str, kafka_behind_proxy: Any, tmp_path: Path
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    events = make_events(topic, 200)
    write_events(db_dsn, events)
    kafka_behind_proxy.proxy.pause()  # publishes hang: relay-a will be caught mid-batch
    doomed = spawn_relay(
        db_dsn,
        kafka_behind_proxy.url,
        tmp_path / "relay-a.log",
        "--relay-id",
        "relay-a",
        "--lease",
        "3",
        "--batch-size",
        "50",
    )
    try:
        await wait_for(
            lambda: count(db_dsn, "claimed_by = 'relay-a' AND claim_token IS NOT NULL") > 0,
            timeout=30,
            what="relay-a to hold a claim",
        )
        doomed.send_signal(signal.SIGKILL)
        assert doomed.wait(10) == -signal.SIGKILL
    finally:
        if doomed.poll() is None:
            doomed.kill()
    held = count(db_dsn, "claim_token IS NOT NULL")
    assert held > 0, "the dead relay's claims are still there, leased"
    kafka_behind_proxy.proxy.resume()
    async with running_relay(
        db_dsn, KafkaPublisher.from_url(kafka_behind_proxy.url), relay_id="relay-b"
    ) as survivor:
        await wait_for(lambda: count(db_dsn) == 0, timeout=40, what="relay-b to finish")
    assert survivor.stats.published == 200
    messages = await asyncio.to_thread(
        consume_kafka, kafka_behind_proxy.bootstrap, topic, 200, 20.0
    )
    ids = _kafka_ids(messages)
    assert set(ids) == {str(e.event_id) for e in events}, "nothing lost"
    assert len(ids) - len(set(ids)) <= 50, "duplicates at most the killed batch"


async def test_graceful_shutdown_releases_leases_so_another_relay_takes_the_rows_at_once(
    db_dsn: str, kafka_behind_proxy: Any, tmp_path: Path
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    write_events(db_dsn, make_events(topic, 100))
    kafka_behind_proxy.proxy.pause()
    relay = spawn_relay(
        db_dsn,
        kafka_behind_proxy.url,
        tmp_path / "relay.log",
        "--relay-id",
        "relay-a",
        "--lease",
        "120",
        "--batch-size",
        "40",
        "--shutdown-timeout",
        "1",
    )
    try:
        await wait_for(
            lambda: count(db_dsn, "claim_token IS NOT NULL") > 0, timeout=30, what="a claim"
        )
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(20) == 0, (tmp_path / "relay.log").read_text()[-3000:]
    finally:
        if relay.poll() is None:
            relay.kill()
    assert count(db_dsn, "claim_token IS NOT NULL") == 0, "leases handed back"
    assert count(db_dsn, "available_at > now()") == 0, "claimable now, not in 120 s"
    assert count(db_dsn, "attempts > 0") == 0, "the unfinished attempt was given back"
    kafka_behind_proxy.proxy.resume()
    async with running_relay(db_dsn, KafkaPublisher.from_url(kafka_behind_proxy.url)):
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="second relay drains")


async def test_broker_down_for_a_while_events_wait_in_the_table_and_drain_when_it_is_back(
    db_dsn: str, fresh_nats: Any
) -> None:
    await ensure_stream(fresh_nats.url, "SHOP", ["shop.>"])
    publisher = NatsPublisher.from_url(fresh_nats.url + "?timeout=0.5")
    events: list[Event] = []
    async with running_relay(db_dsn, publisher, retry_base=0.2, retry_cap=1.0) as relay:
        first = make_events("shop.orders", 50)
        write_events(db_dsn, first)
        events += first
        await wait_for(lambda: count(db_dsn) == 0, what="normal traffic flows")
        fresh_nats.stop()
        for _ in range(5):  # the application keeps committing during the outage
            batch = make_events("shop.orders", 60)
            write_events(db_dsn, batch)
            events += batch
            await asyncio.sleep(0.3)
        await wait_for(lambda: count(db_dsn, "last_error IS NOT NULL") > 0, what="failures")
        assert count(db_dsn) == 300, "the backlog waits in the table"
        fresh_nats.start()
        await wait_for(lambda: count(db_dsn) == 0, timeout=45, what="backlog drained")
        assert relay.stats.released > 0  # handed back untried: the outage burns no attempt
        assert relay.stats.dead_lettered == 0
    msgs = await consume_nats(fresh_nats.url, "SHOP", "shop.>", len(events), 20.0)
    got = [m.headers["Nats-Msg-Id"] for m in msgs]
    assert set(got) == {str(e.event_id) for e in events}
    assert len(got) == len(events), "JetStream dedup absorbed re-publishes"


async def test_relay_reconnects_after_its_database_connections_are_terminated(
    db_dsn: str, kafka_broker: Any
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    async with running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url)) as relay:
        write_events(db_dsn, make_events(topic, 20))
        await wait_for(lambda: count(db_dsn) == 0, what="first events")
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            killed = conn.execute(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name LIKE 'outboxkit-relay%%'"
                " AND datname = current_database()) t"
            ).fetchone()
        assert killed is not None and killed[0] >= 2
        write_events(db_dsn, make_events(topic, 20))
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="events after the kill")
        assert relay.stats.db_reconnects >= 1
    messages = await asyncio.to_thread(consume_kafka, kafka_broker.bootstrap, topic, 40, 20.0)
    assert len(set(_kafka_ids(messages))) == 40


async def test_relay_survives_a_postgres_restart(kafka_broker: Any) -> None:
    # Its own temporary data directory: under root, tmp_path (0700) is out of the server's reach.
    with EmbeddedPostgres(fsync=False) as pg:
        pg.start()
        migrate(pg.dsn)
        topic = f"orders-{uuid.uuid4().hex[:8]}"
        async with running_relay(pg.dsn, KafkaPublisher.from_url(kafka_broker.url)) as relay:
            write_events(pg.dsn, make_events(topic, 10))
            await wait_for(lambda: count(pg.dsn) == 0, what="before the restart")
            await asyncio.to_thread(pg.restart)
            write_events(pg.dsn, make_events(topic, 10))
            await wait_for(lambda: count(pg.dsn) == 0, timeout=30, what="after the restart")
            assert relay.stats.db_reconnects >= 1
    messages = await asyncio.to_thread(consume_kafka, kafka_broker.bootstrap, topic, 20, 20.0)
    assert len(set(_kafka_ids(messages))) == 20


def test_relay_process_exits_0_on_sigterm_when_idle(
    db_dsn: str, kafka_broker: Any, tmp_path: Path
) -> None:
    log_file = tmp_path / "relay.log"
    proc = spawn_relay(db_dsn, kafka_broker.url, log_file)
    try:
        import time

        # Idle means started and claiming: a fixed sleep sent SIGTERM before the signal
        # handler existed on a loaded machine (the process then died of the signal).
        deadline = time.monotonic() + 30
        while "claiming batches" not in log_file.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log_file.read_text()
            time.sleep(0.1)
        time.sleep(0.5)
        assert proc.poll() is None, log_file.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "relay.log").read_text()
    assert "stopped" in log
    assert os.environ.get("PGPASSWORD", "\0") not in log


def test_relay_cli_reports_a_bad_broker_url_without_a_traceback(db_dsn: str) -> None:
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "outboxkit", "relay", "--dsn", db_dsn, "--broker", "ftp://x"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 2
    assert "unsupported broker URL scheme" in out.stderr
    assert "Traceback" not in out.stderr
