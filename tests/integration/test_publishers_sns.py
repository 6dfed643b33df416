"""The SNS publisher against moto's server (real HTTP, real boto3): FIFO grouping and dedup,
the size limit to the byte, a missing topic.

SNS → SQS (raw and enveloped, read by the SQS runner's decoder) and the guarantees every
broker shares (a killed relay, an outage mid-stream, an event carried whole, the
dead-lettering of an oversized event) are in tests/integration/brokers/.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from outboxkit import Event
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.sns import MAX_MESSAGE_BYTES, SnsPublisher
from outboxkit.wire import sqs as sqs_wire
from tests.support.aws_sizes import at_limit, outbound_of
from tests.support.moto_sqs import MotoSqs, running_moto
from tests.support.relaying import count, make_events, rows, running_relay, wait_for, write_events
from tests.support.servers import unique_name


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoSqs]:
    with running_moto(monkeypatch) as server:
        yield server


def _topic_into_queue(moto: MotoSqs, topic: str, *, fifo: bool = False) -> str:
    """A topic with a queue subscribed (raw delivery); the queue's URL."""
    queue_url = moto.create_queue(unique_name("sub") + (".fifo" if fifo else ""))
    sns = moto.client("sns")
    arn = sns.create_topic(Name=topic, Attributes={"FifoTopic": "true"} if fifo else {})["TopicArn"]
    queue_arn = moto.client().get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])[
        "Attributes"
    ]["QueueArn"]
    sns.subscribe(
        TopicArn=arn,
        Protocol="sqs",
        Endpoint=queue_arn,
        Attributes={"RawMessageDelivery": "true"},
    )
    return queue_url


def _url(moto: MotoSqs, topic: str, **options: str) -> str:
    return moto.url(topic, **options).replace("sqs://", "sns://", 1)


def _attrs(message: dict[str, Any]) -> dict[str, str]:
    return {k: v["StringValue"] for k, v in message["MessageAttributes"].items()}


def _sns_size(message: OutboundMessage) -> int:
    """What SNS counts: the body plus each attribute's name, type and value."""
    body, attributes = sqs_wire.encode(message)
    return len(body.encode()) + sum(
        len(k.encode()) + len(b"String") + len(v.encode()) for k, v in attributes.items()
    )


async def test_fifo_topic_groups_by_key_keeps_per_key_order_and_dedups_by_event_id(
    db_dsn: str, moto: MotoSqs
) -> None:
    topic = unique_name("orders") + ".fifo"
    queue_url = _topic_into_queue(moto, topic, fifo=True)
    events = make_events("orders", 60, keys=3)
    events.append(Event(topic="orders", event_type="order.note", payload={"n": 1}))  # no key
    write_events(db_dsn, events)
    publisher = SnsPublisher.from_url(_url(moto, topic))
    async with running_relay(db_dsn, publisher, batch_size=25):
        await wait_for(lambda: count(db_dsn) == 0, what="outbox drained")
    # The relay's batch re-published as after a crash: SNS FIFO's dedup id absorbs it.
    again = await publisher.publish_batch([outbound_of(e) for e in events[:10]])
    assert all(r.ok for r in again)
    messages = await asyncio.to_thread(moto.drain, queue_url)
    ids = [_attrs(m)["ce_id"] for m in messages]
    assert sorted(ids) == sorted(str(e.event_id) for e in events), "each event once"
    for m in messages:
        assert m["Attributes"]["MessageDeduplicationId"] == _attrs(m)["ce_id"]
        assert m["Attributes"]["MessageGroupId"] == _attrs(m).get("ce_partitionkey", "orders")
    for key in ("customer-0", "customer-1", "customer-2"):
        got = [_attrs(m)["ce_id"] for m in messages if _attrs(m).get("ce_partitionkey") == key]
        assert got == [str(e.event_id) for e in events if e.key == key], "per-key order"


async def test_a_message_of_exactly_256_kib_is_published_and_one_byte_more_dead_lettered(
    moto: MotoSqs,
) -> None:
    topic = unique_name("files")
    queue_url = _topic_into_queue(moto, topic)
    fits = at_limit(_sns_size, MAX_MESSAGE_BYTES)
    over = at_limit(_sns_size, MAX_MESSAGE_BYTES, over=1)
    publisher = SnsPublisher.from_url(_url(moto, topic))
    await publisher.start()
    try:
        ok, refused = await publisher.publish_batch([fits, over])
    finally:
        await publisher.close()
    assert ok.ok, ok
    assert (refused.ok, refused.retryable, refused.error_class) == (
        False,
        False,
        "message_too_large",
    )
    assert "262 145 bytes" in str(refused.error) and "262 144" in str(refused.error)
    [got] = await asyncio.to_thread(moto.drain, queue_url)
    assert _attrs(got)["ce_id"] == str(fits.event_id)
    assert got["Body"].encode() == fits.payload, "the 256 KiB message arrived whole"


async def test_a_missing_topic_is_dead_lettered_at_once_naming_it(
    db_dsn: str, moto: MotoSqs
) -> None:
    missing = unique_name("nowhere")
    event = Event(topic="orders", event_type="order.placed", payload={"n": 1})
    write_events(db_dsn, [event])
    async with running_relay(db_dsn, SnsPublisher.from_url(_url(moto, missing))):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="settled")
    [dead] = rows(db_dsn)
    assert (dead["status"], dead["attempts"]) == (2, 1), "dead-lettered at once"
    assert missing in dead["last_error"] and "does not exist" in dead["last_error"]
