"""Kafka and NATS under the faults issue 3 asks of every broker.

A relay killed between publishing a batch and settling it re-publishes that batch: Kafka
shows at most that batch twice, JetStream's `Nats-Msg-Id` window absorbs all of it. A
connection cut in the middle of a stream loses nothing.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.testing import spawn_relay
from tests.support.relay_crash import settles_stalled
from tests.support.relaying import (
    count,
    make_events,
    running_relay,
    wait_for,
    write_events,
)
from tests.support.servers import consume_kafka, consume_nats, ensure_stream

pytestmark = pytest.mark.slow


def _kill_after_publish(
    db_dsn: str, url: str, log: Path, published: Any, batch: int
) -> asyncio.Future[None]:
    """Run relay-a as a process, wait until `published()` is true, then SIGKILL it."""

    async def run() -> None:
        doomed = spawn_relay(
            db_dsn, url, log, "--relay-id", "relay-a", "--lease", "3", "--batch-size", str(batch)
        )
        try:
            await wait_for(published, timeout=30, what="relay-a to publish its whole batch")
            doomed.send_signal(signal.SIGKILL)
            assert doomed.wait(10) == -signal.SIGKILL
        finally:
            if doomed.poll() is None:
                doomed.kill()

    return asyncio.ensure_future(run())


async def test_nats_relay_killed_after_publishing_a_batch_leaves_no_duplicates(
    db_dsn: str, nats_server: Any, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:8]
    subject = f"crash{suffix}.orders"
    stream = f"CRASH{suffix.upper()}"
    await ensure_stream(nats_server.url, stream, [f"crash{suffix}.>"])
    killed_batch = make_events(subject, 40)
    write_events(db_dsn, killed_batch)

    async def whole_batch_at_broker() -> bool:
        got = await consume_nats(nats_server.url, stream, subject, 40, 1.0)
        return len(got) >= 40

    with settles_stalled(db_dsn):
        await _kill_after_publish(
            db_dsn, nats_server.url, tmp_path / "relay-a.log", whole_batch_at_broker, 40
        )
    assert count(db_dsn, "claimed_by = 'relay-a'") == 40, "published, never settled"
    later = make_events(subject, 20)
    write_events(db_dsn, later)
    async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url)) as relay_b:
        await wait_for(lambda: count(db_dsn) == 0, timeout=40, what="relay-b drains")
    assert relay_b.stats.published == 60, "relay-b re-published the killed batch"
    msgs = await consume_nats(nats_server.url, stream, subject, 120, 5.0)
    ids = [m.headers["Nats-Msg-Id"] for m in msgs]
    assert set(ids) == {str(e.event_id) for e in killed_batch + later}, "nothing lost"
    assert len(ids) == 60, "JetStream dropped every re-published duplicate"


async def test_kafka_relay_killed_after_publishing_a_batch_duplicates_at_most_that_batch(
    db_dsn: str, kafka_broker: Any, tmp_path: Path
) -> None:
    topic = f"crash-{uuid.uuid4().hex[:8]}"
    killed_batch = make_events(topic, 40)
    write_events(db_dsn, killed_batch)

    def whole_batch_at_broker() -> bool:
        return len(consume_kafka(kafka_broker.bootstrap, topic, 40, 1.0)) >= 40

    with settles_stalled(db_dsn):
        await _kill_after_publish(
            db_dsn,
            kafka_broker.url,
            tmp_path / "relay-a.log",
            lambda: asyncio.to_thread(whole_batch_at_broker),
            40,
        )
    assert count(db_dsn, "claimed_by = 'relay-a'") == 40, "published, never settled"
    later = make_events(topic, 20)
    write_events(db_dsn, later)
    async with running_relay(db_dsn, KafkaPublisher.from_url(kafka_broker.url)):
        await wait_for(lambda: count(db_dsn) == 0, timeout=40, what="relay-b drains")
    messages = await asyncio.to_thread(consume_kafka, kafka_broker.bootstrap, topic, 100, 5.0)
    ids = [dict(m.headers())["idempotency-key"].decode() for m in messages]
    assert set(ids) == {str(e.event_id) for e in killed_batch + later}, "nothing lost"
    assert 0 < len(ids) - len(set(ids)) <= 40, "only the killed batch is published twice"


async def test_kafka_connection_cut_mid_stream_loses_nothing(
    db_dsn: str, kafka_behind_proxy: Any
) -> None:
    topic = f"cut-{uuid.uuid4().hex[:8]}"
    events = []
    publisher = KafkaPublisher.from_url(kafka_behind_proxy.url)
    async with running_relay(db_dsn, publisher, retry_base=0.2, retry_cap=1.0):
        for wave in range(6):
            batch = make_events(topic, 50)
            write_events(db_dsn, batch)
            events += batch
            if wave == 2:
                kafka_behind_proxy.proxy.cut()
            await asyncio.sleep(0.3)
        assert count(db_dsn) > 0, "events written during the outage wait in the table"
        await asyncio.sleep(2.0)  # an outage longer than a blip
        kafka_behind_proxy.proxy.resume()
        await wait_for(lambda: count(db_dsn) == 0, timeout=60, what="backlog drained")
    messages = await asyncio.to_thread(
        consume_kafka, kafka_behind_proxy.bootstrap, topic, len(events), 20.0
    )
    ids = [dict(m.headers())["idempotency-key"].decode() for m in messages]
    assert set(ids) == {str(e.event_id) for e in events}, "nothing lost"
