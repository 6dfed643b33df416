"""Kafka: CloudEvents binary mode, attributes in ``ce_*`` record headers as UTF-8 bytes.

The record key is the event's key; ``idempotency-key`` carries the event id for readers
that know no CloudEvents; user headers go first and may not shadow either.
"""

from __future__ import annotations

import functools

from outboxkit.tracing import TRACE_HEADERS
from outboxkit.wire.cloudevents import Envelope, Outbound

PREFIX = "ce_"
_SPECVERSION = ("ce_specversion", b"1.0")
_DEFAULT_CONTENT_TYPE = ("content-type", b"application/json")


@functools.lru_cache(maxsize=1024)
def _source(aggregate_type: str | None) -> bytes:
    return f"/outboxkit/{aggregate_type}".encode() if aggregate_type else b"/outboxkit"


def encode_headers(message: Outbound) -> list[tuple[str, bytes]]:
    """User headers, ``idempotency-key``, then CloudEvents ``ce_*`` (binary mode).

    The same list ``OutboundMessage.cloudevents_attributes`` describes, built
    without the intermediate dicts: this runs once per event on the relay's hot path.
    """
    event_id = str(message.event_id).encode()
    headers: list[tuple[str, bytes]] = []
    content_type = _DEFAULT_CONTENT_TYPE
    user = message.headers
    if user:
        # User headers may not shadow the dedup key or the CloudEvents attributes.
        for k, v in user.items():
            if k == "content-type":
                content_type = ("content-type", v.encode())
            elif k != "idempotency-key" and not k.startswith(PREFIX):
                headers.append((k, v.encode()))
    headers += (
        ("idempotency-key", event_id),
        _SPECVERSION,
        ("ce_id", event_id),
        ("ce_type", message.event_type.encode()),
        ("ce_source", _source(message.aggregate_type)),
        ("ce_time", message.time.isoformat().encode()),
        content_type,
    )
    if message.aggregate_id is not None:
        headers.append(("ce_subject", message.aggregate_id.encode()))
    if message.key is not None:
        headers.append(("ce_partitionkey", message.key.encode()))
    if message.schema_version is not None:
        headers.append(("ce_schemaversion", message.schema_version.encode()))
    if user:
        for name in TRACE_HEADERS:
            value = user.get(name)
            if value:
                headers.append((f"{PREFIX}{name}", value.encode()))
    return headers


def decode(
    key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes | None]] | None
) -> Envelope:
    """The envelope of a record written by :func:`encode_headers` (undecodable bytes replaced)."""
    envelope = Envelope(
        payload=value or b"",
        key=key.decode("utf-8", "replace") if key is not None else None,
    )
    for name, raw in headers or []:
        text = raw.decode("utf-8", "replace") if raw is not None else ""
        if name.startswith(PREFIX):
            envelope.attributes[name[len(PREFIX) :]] = text
        elif name == "content-type":
            envelope.content_type = text
        elif name == "idempotency-key":
            envelope.fallback_id = text
        else:
            envelope.headers[name] = text
    return envelope
