"""The WAL envelope: every field survives encode → decode; what is not an envelope is refused."""

from __future__ import annotations

import contextlib
import datetime as dt
import struct
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outboxkit import Event
from outboxkit.cdc.envelope import decode_envelope
from outboxkit.publishers.base import OutboundMessage
from outboxkit.write.wal_envelope import (
    ENVELOPE_VERSION,
    WalEnvelopeError,
    encode_envelope,
    message_prefix,
    parse_envelope,
)

COMMIT = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)

# Text an Event accepts: printable, no control characters (outboxkit.limits), any script.
_text = st.text(alphabet=st.characters(categories=("L", "N", "P", "S")), min_size=1, max_size=40)
_topic = st.from_regex(r"[a-z][a-z0-9._-]{0,30}", fullmatch=True)
_times = st.datetimes(
    min_value=dt.datetime(1, 1, 2),
    max_value=dt.datetime(9999, 12, 30),
    timezones=st.sampled_from([dt.UTC, dt.timezone(dt.timedelta(hours=5, minutes=30))]),
)
_int64 = st.integers(-(2**63), 2**63 - 1)
_short_text = _text.filter(lambda s: len(s) < 60)
_header_names = st.from_regex(r"x-[a-z0-9-]{1,20}", fullmatch=True)


@st.composite
def events(draw: st.DrawFn) -> Event:
    return Event(
        topic=draw(_topic),
        event_type=draw(_text),
        payload=draw(st.binary(max_size=300) | st.dictionaries(st.text(max_size=5), _int64)),
        key=draw(st.none() | _text),
        aggregate_type=draw(st.none() | _text),
        aggregate_id=draw(st.none() | _text),
        headers=draw(st.none() | st.dictionaries(_header_names, _text, max_size=4)),
        occurred_at=draw(_times),
        schema_version=draw(st.none() | st.integers(0, 10**6) | _short_text),
        deliver_at=draw(st.none() | _times),
        event_id=draw(st.uuids()),
    )


def _as_message(event: Event) -> OutboundMessage:
    return OutboundMessage(
        event_id=event.event_id,
        topic=event.topic,
        key=event.key,
        event_type=event.event_type,
        aggregate_type=event.aggregate_type,
        aggregate_id=event.aggregate_id,
        payload=event.payload,
        headers=event.headers,
        created_at=COMMIT,
        attempt=1,
        occurred_at=event.occurred_at,
        schema_version=event.schema_version,
    )


@given(events())
def test_every_field_round_trips(event: Event) -> None:
    data = encode_envelope(event)
    assert data[0] == ENVELOPE_VERSION
    assert decode_envelope(data, commit_time=COMMIT) == _as_message(event)
    parsed = parse_envelope(memoryview(data))
    assert parsed.deliver_at == event.available_at
    assert parsed.occurred_at.tzinfo is dt.UTC  # the same instant, in UTC


@given(events(), st.data())
def test_any_truncation_or_extension_is_refused(event: Event, data: st.DataObject) -> None:
    encoded = encode_envelope(event)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(WalEnvelopeError):
        parse_envelope(encoded[:cut])
    with pytest.raises(WalEnvelopeError, match="add up to"):
        parse_envelope(encoded + b"x")


@given(st.binary(max_size=200))
def test_arbitrary_bytes_parse_or_raise_the_typed_error_only(data: bytes) -> None:
    with contextlib.suppress(WalEnvelopeError):
        parse_envelope(bytes([ENVELOPE_VERSION]) + data)


def test_a_minimal_event_is_compact() -> None:
    event = Event(topic="orders", event_type="order.placed", payload=b"{}")
    data = encode_envelope(event)
    # 48-byte header, the two names, the payload and the content-type header bytes has.
    assert len(data) == 48 + len("orders") + len("order.placed") + 2 + len(
        b'{"content-type":"application/octet-stream"}'
    )
    json_event = Event(topic="orders", event_type="order.placed", payload={})
    assert len(encode_envelope(json_event)) == 48 + 6 + 12 + 2  # no headers: zero bytes


def test_the_traceparent_captured_at_write_time_travels() -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    event = Event(topic="t", event_type="x", payload={}, headers={"traceparent": tp})
    assert decode_envelope(encode_envelope(event), commit_time=COMMIT).headers["traceparent"] == tp


def test_decoded_message_is_a_first_attempt_created_at_the_commit() -> None:
    event = Event(topic="t", event_type="x", payload={"a": 1}, key="k")
    message = decode_envelope(encode_envelope(event), commit_time=COMMIT)
    assert message.attempt == 1
    assert message.created_at == COMMIT
    assert message.time == event.occurred_at  # brokers send occurred_at, not the commit


def test_an_unknown_version_says_which_and_what_to_do() -> None:
    data = bytearray(encode_envelope(Event(topic="t", event_type="x", payload={})))
    data[0] = 2
    with pytest.raises(WalEnvelopeError, match=r"version 2 is unknown.*reads version 1.*upgrade"):
        decode_envelope(bytes(data), commit_time=COMMIT)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"\x01\x00", "truncated"),
        (b'{"topic": "t"}', "version 123 is unknown"),
    ],
)
def test_what_is_not_an_envelope_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(WalEnvelopeError, match=message):
        parse_envelope(data)


def _raw(
    *,
    flags: int = 0,
    topic: bytes = b"t",
    event_type: bytes = b"x",
    key: bytes = b"",
    headers: bytes = b"",
    payload: bytes = b"{}",
) -> bytes:
    head = struct.pack(
        ">BB16sqHHHHHIII",
        1,
        flags,
        uuid.uuid4().bytes,
        0,
        len(topic),
        len(event_type),
        0,
        0,
        0,
        len(key),
        len(headers),
        len(payload),
    )
    return head + topic + key + event_type + headers + payload


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"flags": 0x80}, "unknown flags"),
        ({"topic": b"\xff"}, "topic is not UTF-8"),
        ({"topic": b""}, "must not be empty"),
        ({"key": b"k"}, "key has bytes but its flag is unset"),
        ({"headers": b"[1]"}, "not a JSON object of strings"),
        ({"headers": b'{"a": 1}'}, "not a JSON object of strings"),
        ({"headers": b"{"}, "headers are not JSON"),
        ({"flags": 16}, "add up to|deliver_at is missing"),
    ],
)
def test_malformed_fields_are_refused_by_name(fields: dict[str, object], message: str) -> None:
    assert parse_envelope(_raw()).topic == "t"  # the helper builds a valid envelope
    with pytest.raises(WalEnvelopeError, match=message):
        parse_envelope(_raw(**fields))  # type: ignore[arg-type]


def test_an_empty_key_is_not_a_missing_key() -> None:
    event = Event(topic="t", event_type="x", payload={})
    event.key = ""  # Event refuses nothing here; the format must still tell "" from None
    assert parse_envelope(encode_envelope(event)).key == ""


def test_the_prefix_names_the_outbox() -> None:
    assert message_prefix("outbox") == "outboxkit:outbox"
    assert message_prefix("shop.outbox") == "outboxkit:shop.outbox"


def test_the_wal_statements_name_the_outbox_and_leave_no_slot() -> None:
    from outboxkit.backends.postgres.wal_sql import WalStatements

    s = WalStatements("app.events")
    for name in WalStatements.templates():
        text = getattr(s, name)
        assert "{" not in text, name
        assert "'outboxkit:app.events'" in text, name
    assert '"app"."events"' in s.attached_one  # the zero-row INSERT's table, quoted
    assert s.emit_many.count("%s") == 1 and s.emit_one_notify.count("%s") == 2
    with pytest.raises(ValueError, match="invalid outbox table name"):
        WalStatements("x'; DROP TABLE y; --")
