"""A Kafka broker that forgets the relay's producer id fences it; the relay must recover alone.

The fault is real: the Tansu broker (memory storage) is stopped and started again on the same
port while the relay has whole batches in flight. The new broker knows nothing of the idempotent
producer's id, so librdkafka's retried ProduceRequests fail with UNKNOWN_PRODUCER_ID and the
producer enters librdkafka's fatal state ("unable to retry without risking duplication/
reordering"). confluent-kafka reports that fatal error by raising it from ``poll()``, not
through ``error_cb``; every later ``produce()`` raises ``_FATAL``.

Before the fix the exception killed the publisher's poll thread, so no delivery report was served
any more: the batches in flight waited for the publish timeout, every later batch failed at once
with ``error_class=_FATAL`` (attempts counted, one WARNING per event) and the producer was never
recreated, so healthy events were dead-lettered after ``max_attempts``.

To know exactly what the broker must end up with, the relay reaches the broker through a TCP proxy
that holds every byte while the load is produced: the old broker receives none of those events
and acknowledges none of them, so every one of them must be read back from the new broker. (The
warm-up events the old broker did acknowledge are lost with its memory storage; they only give
the producer a producer id and sequence numbers to be fenced on.)
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from outboxkit.publishers import kafka as kafka_module
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.kafka import KafkaPublisher
from tests.support.relaying import count, make_events, rows, running_relay, wait_for, write_events
from tests.support.servers import consume_kafka

_LOAD = 3000


@pytest.mark.slow
async def test_kafka_producer_fenced_by_a_broker_restart_is_recreated_and_loses_nothing(
    db_dsn: str, kafka_behind_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    topic = f"fenced-{uuid.uuid4().hex[:8]}"
    broker, proxy = kafka_behind_proxy.broker, kafka_behind_proxy.proxy
    publisher = KafkaPublisher.from_url(kafka_behind_proxy.url)
    async with running_relay(
        db_dsn, publisher, retention="keep", max_attempts=3, lease=15.0
    ) as relay:
        write_events(db_dsn, make_events(topic, 50))
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="warm-up published")

        proxy.pause()  # the load's ProduceRequests are sent, held, never reach the old broker
        load = make_events(topic, _LOAD)
        write_events(db_dsn, load)
        await wait_for(
            lambda: relay.stats.claimed >= 50 + _LOAD, what="the whole load claimed, in flight"
        )
        await asyncio.sleep(0.5)  # librdkafka has sent its requests into the proxy
        caplog.clear()
        await asyncio.to_thread(broker.stop)
        await asyncio.to_thread(broker.start)  # same port, empty: the producer id is unknown
        proxy.resume()

        await wait_for(
            lambda: count(db_dsn, "status = 0") == 0,
            timeout=60,
            what="every event settled after the restart",
        )
    settled = rows(db_dsn, f"topic = '{topic}'")
    load_ids = {str(e.event_id) for e in load}
    load_rows = [r for r in settled if str(r["event_id"]) in load_ids]
    assert {r["status"] for r in load_rows} == {1}, "no event dead-lettered"
    assert max(r["attempts"] for r in load_rows) == 1, "handed back without burning attempts"
    assert relay.stats.released > 0, "the fenced batches were handed back"

    ids: list[str] = []
    for wanted in (_LOAD, 2 * _LOAD):  # the second read only if duplicates hid some
        messages = await asyncio.to_thread(consume_kafka, broker.bootstrap, topic, wanted, 10.0)
        ids = [dict(m.headers() or [])["idempotency-key"].decode() for m in messages]
        if set(ids) >= load_ids:
            break
    assert set(ids) >= load_ids, f"{len(load_ids - set(ids))} event(s) missing at the broker"

    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    recreated = [r for r in warnings if "recreat" in r.getMessage()]
    assert len(recreated) == 1, [r.getMessage() for r in warnings]
    assert "UNKNOWN_PRODUCER_ID" in recreated[0].getMessage(), "the cause is in the line"
    # The relay may say once that publishing is failing (sink/outage.py), never once per event.
    relay_lines = [r.getMessage() for r in warnings if r.name == "outboxkit.relay"]
    assert len(relay_lines) <= 2, relay_lines[:5]
    assert not [line for line in relay_lines if "event_id=" in line], relay_lines[:5]


# -- every other place a fatal error surfaces: the recovery logic as a pure unit ----------------
#
# librdkafka cannot be made to report a fatal error through error_cb, flush() or a delivery report
# on demand (confluent-kafka does not expose rd_kafka_test_fatal_error), so these drive the
# publisher with a stand-in Producer that reports one where the real one may.


class _FakeProducer:
    """Queues produce() calls; delivers them on poll() unless told to fail."""

    made: list[_FakeProducer] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.queued: list[Any] = []
        self.fatal: KafkaError | None = None  # produce() raises _FATAL once set
        self.deliver = True
        self.flush_raises: KafkaError | None = None
        self.poll_raises: KafkaError | None = None
        _FakeProducer.made.append(self)

    def produce(  # confluent-kafka's parameters, in its positional order
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        partition: int = -1,
        callback: Any = None,
        on_delivery: Any = None,
        timestamp: int = 0,
        headers: Any = None,
    ) -> None:
        if self.fatal is not None:
            raise KafkaException(KafkaError(KafkaError._FATAL, "Local: Fatal error"))
        self.queued.append(callback if callback is not None else on_delivery)

    def poll(self, timeout: float) -> int:
        if self.poll_raises is not None:
            err, self.poll_raises = self.poll_raises, None
            self.fatal = err
            raise KafkaException(err)
        if self.deliver:
            while self.queued:
                self.queued.pop(0)(None, None)
        time.sleep(min(timeout, 0.01))
        return 0

    def flush(self, timeout: float) -> int:
        if self.flush_raises is not None:
            err, self.flush_raises = self.flush_raises, None
            self.fatal = err
            raise KafkaException(err)
        return 0

    def purge(self) -> None:
        queued, self.queued = self.queued, []
        for callback in queued:
            callback(KafkaError(KafkaError._PURGE_QUEUE), None)

    def list_topics(self, *_args: Any) -> None:
        return None


def _fatal(code: int = KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER) -> KafkaError:
    return KafkaError(code, "sequence gap", fatal=True)


def _messages(n: int) -> list[OutboundMessage]:
    return [
        OutboundMessage(
            event_id=uuid.uuid4(),
            topic="orders",
            key="k",
            event_type="order.placed",
            aggregate_type=None,
            aggregate_id=None,
            payload=b"{}",
            headers={},
            created_at=dt.datetime.now(dt.UTC),
        )
        for _ in range(n)
    ]


@pytest.fixture
def fake_kafka(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_FakeProducer]]:
    monkeypatch.setattr(kafka_module, "Producer", _FakeProducer)
    _FakeProducer.made = []
    yield _FakeProducer


async def _fail_fatally(surface: str, producer: _FakeProducer) -> None:
    """Make the fake producer report a fatal error the way `surface` does."""
    if surface == "error_cb":
        producer.config["error_cb"](_fatal())
    elif surface == "delivery_report":
        producer.fatal = _fatal()
        producer.queued.pop(0)(_fatal(), None)
    elif surface == "poll":
        producer.poll_raises = _fatal()
    # "flush": armed before the batch, raised by the flush a small batch runs at once


@pytest.mark.parametrize("surface", ["error_cb", "delivery_report", "poll", "flush"])
async def test_a_fatal_error_from_any_surface_hands_the_batch_back_and_recreates_once(
    fake_kafka: type[_FakeProducer], surface: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="outboxkit.kafka")
    publisher = KafkaPublisher({"bootstrap.servers": "127.0.0.1:9"})
    await publisher.start()
    first = fake_kafka.made[0]
    first.deliver = False  # the batch waits for reports that never come, as when fenced
    if surface == "flush":
        first.flush_raises = _fatal()
    batch = asyncio.ensure_future(publisher.publish_batch(_messages(5)))
    await wait_for(lambda: len(first.queued) == 5, what="the batch produced")
    await _fail_fatally(surface, first)
    results = await asyncio.wait_for(batch, 5)
    assert all(not r.ok and not r.counts_attempt for r in results), results
    assert "OUT_OF_ORDER_SEQUENCE_NUMBER" in (results[0].error or "")

    again = await asyncio.wait_for(publisher.publish_batch(_messages(5)), 5)
    assert all(r.ok for r in again), "a new producer publishes"
    assert len(fake_kafka.made) == 2
    recreated = [r.getMessage() for r in caplog.records if "recreat" in r.getMessage()]
    assert len(recreated) == 1 and "OUT_OF_ORDER_SEQUENCE_NUMBER" in recreated[0], recreated
    assert "5 event(s)" in recreated[0]
    await publisher.close()


async def test_produce_raising_fatal_hands_back_the_rest_of_the_batch_at_once(
    fake_kafka: type[_FakeProducer],
) -> None:
    publisher = KafkaPublisher({"bootstrap.servers": "127.0.0.1:9"})
    await publisher.start()
    fake_kafka.made[0].fatal = _fatal()  # already fatal, not yet reported anywhere
    results = await asyncio.wait_for(publisher.publish_batch(_messages(300)), 5)
    assert all(not r.ok and not r.counts_attempt for r in results)
    again = await asyncio.wait_for(publisher.publish_batch(_messages(3)), 5)
    assert all(r.ok for r in again) and len(fake_kafka.made) == 2
    await publisher.close()


async def test_a_producer_failing_again_soon_after_recreation_waits_before_the_next(
    fake_kafka: type[_FakeProducer],
) -> None:
    """No hot loop of recreations: rows are handed back with a growing retry_after."""
    publisher = KafkaPublisher({"bootstrap.servers": "127.0.0.1:9"})
    await publisher.start()
    fake_kafka.made[0].fatal = _fatal()
    await publisher.publish_batch(_messages(1))  # fatal, first time: recreated at once
    await publisher.publish_batch(_messages(1))  # producer 2
    fake_kafka.made[1].fatal = _fatal()
    await publisher.publish_batch(_messages(1))  # fatal again within a minute
    [held] = await publisher.publish_batch(_messages(1))
    assert not held.counts_attempt and held.retry_after is not None
    assert 0.5 < held.retry_after <= 1.0, held
    assert len(fake_kafka.made) == 2, "not recreated before the wait is over"
    await publisher.close()
