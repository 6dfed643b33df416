"""The memory:// broker of the testing kit: failures on cue, cuts, the bindings' headers."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

import pytest

from outboxkit.consumers.base import from_envelope
from outboxkit.errors import ConfigurationError
from outboxkit.publishers import from_url
from outboxkit.publishers.base import OutboundMessage, unreachable
from outboxkit.publishers.memory import MemoryBroker, MemoryPublisher


def _message(topic: str = "orders", event_type: str = "order.placed") -> OutboundMessage:
    return OutboundMessage(
        uuid.uuid4(),
        topic,
        "customer 1%",
        event_type,
        "order",
        "1",
        b'{"order": 1}',
        {"tenant": "acme"},
        dt.datetime(2026, 1, 2, tzinfo=dt.UTC),
    )


def _publish(publisher: MemoryPublisher, *messages: OutboundMessage) -> list:
    return asyncio.run(publisher.publish_batch(messages))


def test_failures_on_cue_apply_to_matching_messages_only_and_in_turn() -> None:
    publisher = MemoryPublisher(MemoryBroker("t"))
    publisher.broker.fail(2, event_type="order.cancelled")
    publisher.broker.fail(permanent=True, topic="audit")
    placed, cancelled, audit = _message(), _message(event_type="order.cancelled"), _message("audit")
    results = _publish(publisher, placed, cancelled, audit, cancelled, cancelled)
    assert [(r.ok, r.retryable) for r in results] == [
        (True, True),
        (False, True),
        (False, False),
        (False, True),
        (True, True),
    ]
    assert [m.event_id for m in publisher.broker.messages] == [placed.event_id, cancelled.event_id]
    assert len(publisher.broker.failures) == 3


def test_a_cut_broker_hands_publishes_back_untried_and_reports_itself_unreachable() -> None:
    publisher = MemoryPublisher(MemoryBroker("t"))
    publisher.broker.cut()
    [result] = _publish(publisher, _message())
    assert (result.ok, result.counts_attempt) == (False, False)
    assert unreachable(publisher) is not None
    publisher.broker.restore()
    assert unreachable(publisher) is None
    assert _publish(publisher, _message())[0].ok


@pytest.mark.parametrize(
    ("binding", "id_header", "key_header"),
    [("kafka", "ce_id", "ce_partitionkey"), ("nats", "ce-id", "ce-partitionkey"),
     ("webhook", "ce-id", "ce-partitionkey")],
)  # fmt: skip
def test_each_binding_records_its_own_headers_and_decodes_back(
    binding: str, id_header: str, key_header: str
) -> None:
    publisher = from_url(f"memory://unit-{binding}?binding={binding}")
    assert isinstance(publisher, MemoryPublisher)
    message = _message()
    _publish(publisher, message)
    [wire] = publisher.broker.messages
    assert wire.headers[id_header] == str(message.event_id)
    assert key_header in wire.headers
    got = from_envelope(wire.topic, wire.envelope())
    assert (got.event_id, got.key) == (message.event_id, "customer 1%")
    assert got.payload == message.payload
    assert got.headers == {"tenant": "acme"}
    MemoryBroker.forget(publisher.broker.name)


def test_unknown_bindings_and_options_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigurationError, match="kafka, nats, webhook"):
        from_url("memory://x?binding=amqp")
    with pytest.raises(ConfigurationError, match="binding="):
        from_url("memory://x?timeout=1")
