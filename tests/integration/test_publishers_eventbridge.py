"""The EventBridge publisher against moto's server (real HTTP, real boto3): a rule routing to
an SQS queue, the entry limit to the byte, a missing bus.

The guarantees every broker shares (a killed relay, an outage mid-stream, an event carried
whole, the dead-lettering of an oversized event) are in tests/integration/brokers/.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import orjson
import pytest

from outboxkit import Event
from outboxkit.consumers.sqs import decode
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.eventbridge import MAX_ENTRY_BYTES, EventBridgePublisher
from outboxkit.wire import eventbridge as wire
from tests.support.aws_sizes import at_limit
from tests.support.moto_sqs import MotoSqs, running_moto
from tests.support.relaying import count, rows, running_relay, wait_for, write_events
from tests.support.servers import unique_name


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoSqs]:
    with running_moto(monkeypatch) as server:
        yield server


def _bus_into_queue(moto: MotoSqs, bus: str, pattern: dict[str, object]) -> str:
    """A bus with one rule targeting a fresh queue; the queue's URL."""
    queue_url = moto.create_queue(unique_name("target"))
    events = moto.client("events")
    events.create_event_bus(Name=bus)
    events.put_rule(Name="r", EventBusName=bus, EventPattern=orjson.dumps(pattern).decode())
    queue_arn = moto.client().get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])[
        "Attributes"
    ]["QueueArn"]
    events.put_targets(Rule="r", EventBusName=bus, Targets=[{"Id": "q", "Arn": queue_arn}])
    return queue_url


def _url(moto: MotoSqs, bus: str) -> str:
    return moto.url(bus).replace("sqs://", "eventbridge://", 1)


def _entry_size(message: OutboundMessage) -> int:
    return wire.encode(message)[1]


async def test_rules_match_on_detail_type_and_the_payload_fields(
    db_dsn: str, moto: MotoSqs
) -> None:
    bus = unique_name("orders")
    queue_url = _bus_into_queue(
        moto, bus, {"detail-type": ["order.placed"], "detail": {"data": {"vip": [True]}}}
    )
    vip = Event(topic="orders", event_type="order.placed", payload={"vip": True}, key="c-1")
    plain = Event(topic="orders", event_type="order.placed", payload={"vip": False}, key="c-2")
    other = Event(topic="orders", event_type="order.paid", payload={"vip": True}, key="c-1")
    write_events(db_dsn, [vip, plain, other])
    async with running_relay(db_dsn, EventBridgePublisher.from_url(_url(moto, bus))):
        await wait_for(lambda: count(db_dsn) == 0, what="outbox drained")
    [got] = await asyncio.to_thread(moto.drain, queue_url)
    assert decode("orders", got).event_id == vip.event_id, "the rule saw type and payload"


async def test_an_entry_of_exactly_256_kib_is_put_and_one_byte_more_dead_lettered(
    moto: MotoSqs,
) -> None:
    bus = unique_name("files")
    queue_url = _bus_into_queue(moto, bus, {"detail": {"specversion": ["1.0"]}})
    fits = at_limit(_entry_size, MAX_ENTRY_BYTES)
    over = at_limit(_entry_size, MAX_ENTRY_BYTES, over=1)
    publisher = EventBridgePublisher.from_url(_url(moto, bus))
    await publisher.start()
    try:
        ok, refused = await publisher.publish_batch([fits, over])
    finally:
        await publisher.close()
    assert ok.ok, ok
    assert (refused.retryable, refused.error_class) == (False, "message_too_large")
    assert "262 145 bytes" in str(refused.error) and "262 144" in str(refused.error)
    [got] = await asyncio.to_thread(moto.drain, queue_url)
    event = decode("files", got)
    assert event.event_id == fits.event_id and event.payload == fits.payload


async def test_a_missing_bus_is_dead_lettered_at_once_naming_it(db_dsn: str, moto: MotoSqs) -> None:
    missing = unique_name("nowhere")
    write_events(db_dsn, [Event(topic="orders", event_type="order.placed", payload={"n": 1})])
    async with running_relay(db_dsn, EventBridgePublisher.from_url(_url(moto, missing))):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="settled")
    [dead] = rows(db_dsn)
    assert (dead["status"], dead["attempts"]) == (2, 1), "dead-lettered at once"
    assert missing in dead["last_error"] and "does not exist" in dead["last_error"]
