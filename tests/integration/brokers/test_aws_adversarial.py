"""The AWS targets under faults, checked from the receiving side.

1. Writers commit keyed events (a quarter of the transactions rolled back) while an
   ``outboxkit relay --ordered`` process publishes them; it is SIGKILLed once mid-stream
   and another takes over. Read back from the queue (SNS, EventBridge) or every shard
   (Kinesis): nothing lost, nothing phantom (no rolled-back or unknown event), and on the
   services that keep order (SNS FIFO, Kinesis) each key's events in commit order (first
   occurrence of an id; SNS FIFO must show no repeat at all, its dedup id absorbing the
   killed relay's batch). 400 events here; ``OUTBOXKIT_TEST_AWS_EVENTS=2000`` for the long run.
2. The endpoint is stopped for ten seconds while events are written, then restarted on its
   data: with ``max_attempts=3`` and retries every fraction of a second, a relay charging
   attempts for the outage would dead-letter them; nothing is.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import uuid
from collections import defaultdict
from pathlib import Path

import psycopg
import pytest

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.publishers import from_url
from outboxkit.testing import spawn_relay
from tests.integration.brokers.harness import BrokerHarness
from tests.support.relaying import count, running_relay, wait_for, write_events

EVENTS = int(os.environ.get("OUTBOXKIT_TEST_AWS_EVENTS", "400"))
KEYS = 16
ORDERED = {"sns-fifo", "kinesis"}


class Writer:
    """One writer: transactions of 1-3 keyed events, a quarter rolled back, paced."""

    def __init__(self, dsn: str, topic: str, seed: int) -> None:
        self.dsn, self.topic = dsn, topic
        self.random = random.Random(seed)
        self.committed: list[Event] = []  # in commit order (one writer: id order)
        self.rolled_back: set[uuid.UUID] = set()

    def run(self, n: int, pause: float) -> None:
        import time

        outbox = Outbox(ordered=True)
        with psycopg.connect(self.dsn) as conn:
            written = 0
            while written < n:
                events = [
                    Event(
                        topic=self.topic,
                        event_type="order.placed",
                        payload={"n": written + i},
                        key=f"customer-{self.random.randrange(KEYS)}",
                    )
                    for i in range(min(self.random.randint(1, 3), n - written))
                ]
                rollback = self.random.random() < 0.25
                with conn.transaction(force_rollback=rollback):
                    outbox.put_many(conn, events)
                if rollback:
                    self.rolled_back |= {e.event_id for e in events}
                else:
                    self.committed += events
                    written += len(events)
                time.sleep(pause)


ADVERSARIAL = ["sns-fifo", "kinesis", "sns", "eventbridge"]


@pytest.mark.slow
@pytest.mark.parametrize("broker", ADVERSARIAL, indirect=True)
async def test_relay_killed_mid_stream_loses_nothing_adds_nothing_and_keeps_key_order(
    db_dsn: str, broker: BrokerHarness, tmp_path: Path
) -> None:
    migrate(db_dsn, ordered=True, partitions=4)
    await broker.open(cuttable=False)
    topic = await broker.destination()
    writer = Writer(db_dsn, topic, seed=EVENTS)
    writing = asyncio.create_task(asyncio.to_thread(writer.run, EVENTS, 0.004))
    args = ("--ordered", "--lease", "3", "--batch-size", "50", "--poll-interval", "0.1")
    relay_a = spawn_relay(db_dsn, broker.url, tmp_path / "relay-a.log", "--relay-id", "a", *args)
    try:

        async def a_quarter_out() -> bool:
            return await broker.published(topic) >= EVENTS // 4

        await wait_for(a_quarter_out, timeout=60, what="relay-a publishes a quarter")
        relay_a.send_signal(signal.SIGKILL)
        assert relay_a.wait(10) == -signal.SIGKILL
    finally:
        if relay_a.poll() is None:
            relay_a.kill()
    relay_b = spawn_relay(db_dsn, broker.url, tmp_path / "relay-b.log", "--relay-id", "b", *args)
    try:
        await writing
        # moto's SQS (behind SNS, EventBridge) slows as its queue grows: the long run waits longer.
        drain = max(120.0, EVENTS * 0.3)
        await wait_for(lambda: count(db_dsn) == 0, timeout=drain, what="relay-b drains")
    finally:
        relay_b.send_signal(signal.SIGTERM)
        relay_b.wait(20)
    received = await broker.received(topic, len(writer.committed), timeout=30)
    ids = [r.event_id for r in received]
    committed = {e.event_id for e in writer.committed}
    assert writer.rolled_back, "some transactions were rolled back"
    assert committed - set(ids) == set(), "lost"
    assert set(ids) & writer.rolled_back == set(), "phantom: a rolled-back event arrived"
    assert set(ids) - committed == set(), "unknown events arrived"
    if broker.dedups:
        assert len(ids) == len(set(ids)), f"{broker.name} absorbed the re-published batch"
    if broker.name in ORDERED:
        by_key: dict[str | None, list[uuid.UUID]] = defaultdict(list)
        seen: set[uuid.UUID] = set()
        for r in received:
            if r.event_id not in seen:
                seen.add(r.event_id)
                by_key[r.key].append(r.event_id)
        for key in {e.key for e in writer.committed}:
            expected = [e.event_id for e in writer.committed if e.key == key]
            assert by_key[key] == expected, f"the order of {key}"


OUTAGE = ["sns", "kinesis", "eventbridge"]


@pytest.mark.exclusive
@pytest.mark.parametrize("broker", OUTAGE, indirect=True)
async def test_endpoint_down_ten_seconds_dead_letters_nothing(
    db_dsn: str, broker: BrokerHarness
) -> None:
    await broker.open(cuttable=True)
    topic = await broker.destination()
    before = [Event(topic=topic, event_type="t", payload={"n": i}, key="k") for i in range(20)]
    during = [Event(topic=topic, event_type="t", payload={"n": i}, key="k") for i in range(40)]
    write_events(db_dsn, before)
    publisher = from_url(broker.publisher_url)
    async with running_relay(
        db_dsn, publisher, max_attempts=3, retry_base=0.1, retry_cap=0.3
    ) as relay:
        await wait_for(lambda: count(db_dsn) == 0, what="published before the outage")
        await broker.cut()
        for i in range(0, len(during), 10):
            write_events(db_dsn, during[i : i + 10])
            await asyncio.sleep(2.5)  # ten seconds down in all
        assert count(db_dsn) == len(during), "waiting in the table"
        await broker.restore()
        await wait_for(lambda: count(db_dsn) == 0, timeout=60, what="backlog drained")
        assert relay.stats.dead_lettered == 0, "the outage dead-lettered nothing"
        assert relay.stats.released > 0, "handed back untried, no attempt charged"
    ids = {r.event_id for r in await broker.received(topic, len(before) + len(during))}
    assert ids >= {e.event_id for e in before + during}, "nothing lost"
