"""The Kafka publisher's batch encoder writes each event's CloudEvents record exactly.

``encode_records`` (the relay's hot path, issue 42 §3) inlines the per-event work and
finds the second of UTC time by comparing against the last event's: every record must
still be the one the binding says (built here from ``cloudevents_attributes()``, the
slow way), across zones, second boundaries and the optional fields, and one bad row must
not fail its batch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
import uuid
import zoneinfo

import pytest

from outboxkit import OutboundMessage
from outboxkit.tracing import TRACE_HEADERS
from outboxkit.wire.kafka import encode_record, encode_records

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _reference(m: OutboundMessage) -> tuple[list[tuple[str, bytes]], int]:
    """The record as docs/wire-format describes it, from the attributes, no fast path."""
    attrs = m.cloudevents_attributes()
    headers = [
        (k, v.encode())
        for k, v in m.headers.items()
        if k not in ("content-type", "idempotency-key") and not k.startswith("ce_")
    ]
    headers += [("idempotency-key", attrs["id"].encode()), ("ce_specversion", b"1.0")]
    for name in ("id", "type", "source", "time"):
        headers.append((f"ce_{name}", attrs[name].encode()))
    headers.append(("content-type", attrs["datacontenttype"].encode()))
    for name in ("subject", "partitionkey", "schemaversion", *TRACE_HEADERS):
        if name in attrs:
            headers.append((f"ce_{name}", attrs[name].encode()))
    return headers, (m.time - _EPOCH) // dt.timedelta(milliseconds=1)


def _message(time: dt.datetime, i: int) -> OutboundMessage:
    return OutboundMessage(
        event_id=uuid.uuid4(),
        topic="orders",
        key=f"customer-{i % 7}" if i % 5 else None,
        event_type="order.placed" if i % 3 else "order.paid",
        aggregate_type="order" if i % 4 else None,
        aggregate_id=str(i) if i % 6 else None,
        payload=b"{}",
        headers=[
            {},
            {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "x": "y"},
            {"content-type": "text/plain", "ce_id": "no", "idempotency-key": "no"},
            {"tracestate": "a=b", "ünï": "cödé"},
        ][i % 4],
        created_at=time,
        occurred_at=time - dt.timedelta(seconds=i % 3) if i % 2 else None,
        schema_version=str(i % 3) if i % 3 else None,
    )


def test_the_same_records_as_encode_record() -> None:
    rng = random.Random(42)
    zones: list[dt.tzinfo] = [dt.UTC, dt.timezone(dt.timedelta(hours=2))]
    for name in ("UTC", "Etc/UTC", "Europe/Paris"):
        zones.append(zoneinfo.ZoneInfo(name))
    start = dt.datetime(2026, 12, 6, 2, 59, 59, 999_000, tzinfo=dt.UTC)
    messages = []
    for i in range(2_000):
        # Mostly increasing times a few hundred µs apart (a drained backlog), some whole
        # seconds (microsecond 0), jumps back, and every zone in turn.
        start += dt.timedelta(microseconds=rng.choice([0, 1, 250, 999, 1000, 400_000]))
        time = start.replace(microsecond=0) if i % 97 == 0 else start
        if i % 50 == 0:
            time -= dt.timedelta(seconds=3)
        messages.append(_message(time.astimezone(zones[(i // 200) % len(zones)]), i))
    expected = [_reference(m) for m in messages]
    assert encode_records(messages) == expected
    assert [encode_record(m) for m in messages] == expected
    assert encode_records([]) == []


def test_a_row_that_cannot_be_encoded_fails_alone() -> None:
    now = dt.datetime.now(dt.UTC)
    good = _message(now, 1)
    bad_headers = dataclasses.replace(_message(now, 2), headers=["not", "a", "dict"])  # type: ignore[arg-type]
    surrogate = dataclasses.replace(_message(now, 3), aggregate_id="\ud800")
    naive = dataclasses.replace(_message(now, 4), created_at=now.replace(tzinfo=None))
    records = encode_records([good, bad_headers, surrogate, naive, good])
    assert records[0] == records[4] == _reference(good)
    assert all(isinstance(r, str) and r for r in records[1:4])
    for bad in (bad_headers, surrogate, naive):  # one at a time: raised, as before
        with pytest.raises((AttributeError, TypeError, ValueError)):
            encode_record(bad)
