"""The event envelope validates at construction, before anything reaches a database."""

from __future__ import annotations

import uuid

import orjson
import pytest

from outboxkit import Event, InvalidEventError


def test_event_gets_a_time_ordered_uuid7_at_construction() -> None:
    a = Event(topic="orders", event_type="order.placed", payload={})
    b = Event(topic="orders", event_type="order.placed", payload={})
    assert a.event_id.version == 7
    assert a.event_id != b.event_id
    assert a.event_id.bytes[:6] <= b.event_id.bytes[:6]


def test_json_payload_is_encoded_once_with_orjson() -> None:
    e = Event(topic="t", event_type="x", payload={"id": 1, "items": [1, 2]})
    assert e.payload == orjson.dumps({"id": 1, "items": [1, 2]})
    assert "content-type" not in e.headers  # JSON is the default, costs no bytes


def test_bytes_payload_passes_through_untouched() -> None:
    raw = b"\x00\xffnot json"
    e = Event(topic="t", event_type="x", payload=raw)
    assert e.payload == raw
    assert e.headers["content-type"] == "application/octet-stream"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"topic": "", "event_type": "x", "payload": {}}, "topic"),
        ({"topic": "   ", "event_type": "x", "payload": {}}, "topic"),
        ({"topic": "t", "event_type": "", "payload": {}}, "event_type"),
        ({"topic": "t", "event_type": "x", "payload": {1, 2}}, "not JSON-serialisable"),
        ({"topic": "t", "event_type": "x", "payload": object()}, "not JSON-serialisable"),
        ({"topic": "t", "event_type": "x", "payload": {}, "headers": {"a": 1}}, "must be a string"),
        ({"topic": "t", "event_type": "x", "payload": {}, "key": 42}, "key must be a string"),
        ({"topic": "t", "event_type": "x", "payload": {}, "aggregate_id": uuid.uuid4()}, "str()"),
    ],
)
def test_invalid_events_raise_a_clear_error(kwargs: dict[str, object], message: str) -> None:
    # An unserialisable payload raises at its first use (an Outbox's default= may know it).
    with pytest.raises(InvalidEventError, match=message):
        _ = Event(**kwargs).payload  # type: ignore[arg-type]


def test_payload_over_the_configured_maximum_is_refused() -> None:
    e = Event(topic="t", event_type="x", payload=b"x" * 11)
    e.check_size(11)
    with pytest.raises(InvalidEventError, match="over max_payload_bytes=10"):
        e.check_size(10)


def test_repr_never_shows_the_payload() -> None:
    e = Event(topic="t", event_type="x", payload={"card": "4111111111111111"})
    assert "4111" not in repr(e)
