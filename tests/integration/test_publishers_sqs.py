"""The SQS publisher against moto's SQS server (real HTTP, real boto3), through the real relay.

The guarantees every broker shares (a killed relay, an outage mid-stream, an event carried
whole) are in tests/integration/brokers/.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from outboxkit import Event
from outboxkit.publishers.sqs import SqsPublisher
from tests.support.moto_sqs import MotoSqs
from tests.support.relaying import (
    count,
    make_events,
    rows,
    running_relay,
    wait_for,
    write_events,
)
from tests.support.servers import unique_name


@pytest.fixture
def sqs(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoSqs]:
    # Dummy credentials through the normal boto3 chain; relay processes inherit them.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    server = MotoSqs()
    server.start()
    yield server
    server.stop()


def _ids(messages: list[dict[str, Any]]) -> list[str]:
    return [m["MessageAttributes"]["ce_id"]["StringValue"] for m in messages]


def _attrs(message: dict[str, Any]) -> dict[str, str]:
    return {k: v["StringValue"] for k, v in message["MessageAttributes"].items()}


async def test_fifo_queue_groups_by_key_and_deduplicates_by_event_id(
    db_dsn: str, sqs: MotoSqs
) -> None:
    queue = unique_name("orders") + ".fifo"
    queue_url = sqs.create_queue(queue)
    events = make_events("orders", 30, keys=3)
    keyless = Event(topic="orders", event_type="order.note", payload={"n": 1})
    events.append(keyless)
    write_events(db_dsn, events)
    async with running_relay(db_dsn, SqsPublisher.from_url(sqs.url(queue))):
        await wait_for(lambda: count(db_dsn) == 0, what="outbox drained")
    messages = await asyncio.to_thread(sqs.drain, queue_url)
    assert sorted(_ids(messages)) == sorted(str(e.event_id) for e in events)
    for m in messages:
        assert m["Attributes"]["MessageDeduplicationId"] == _attrs(m)["ce_id"]
        expected_group = _attrs(m).get("ce_partitionkey", "orders")  # keyless: the topic
        assert m["Attributes"]["MessageGroupId"] == expected_group
    for key in ("customer-0", "customer-1", "customer-2"):
        in_queue = [_attrs(m)["ce_id"] for m in messages if _attrs(m).get("ce_partitionkey") == key]
        assert in_queue == [str(e.event_id) for e in events if e.key == key], "per-key order"


async def test_a_missing_queue_is_dead_lettered_at_once(db_dsn: str, sqs: MotoSqs) -> None:
    # (An event over the queue's size limit: tests/integration/brokers/test_sizes.py.)
    queue = unique_name("files")
    queue_url = sqs.create_queue(queue)
    fits = Event(topic=queue, event_type="file.stored", payload=b"y" * 200_000)
    lost = Event(topic=unique_name("nowhere"), event_type="file.stored", payload=b"z")
    write_events(db_dsn, [fits, lost])
    # one queue per topic: sqs://{topic}
    async with running_relay(db_dsn, SqsPublisher.from_url(sqs.url("{topic}"))):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="all settled")
    [dead] = rows(db_dsn)
    assert dead["event_id"] == lost.event_id
    assert (dead["status"], dead["attempts"]) == (2, 1), "at once"
    assert "does not exist" in dead["last_error"]
    assert _ids(await asyncio.to_thread(sqs.drain, queue_url)) == [str(fits.event_id)]
