"""The binary envelope of an event written to the WAL (``Outbox(storage="wal")``).

One ``pg_logical_emit_message(true, 'outboxkit:<table>', envelope)`` per event: no
row, so the envelope carries every field a row would. The format is versioned by its
first byte; a reader refuses a version it does not know (:class:`WalEnvelopeError`)
rather than guess. Version 1, all integers big-endian::

    B      version (1)
    B      flags: 1 key, 2 aggregate_type, 4 aggregate_id, 8 schema_version, 16 deliver_at
    16s    event_id (UUID bytes)
    q      occurred_at, microseconds since 1970-01-01 UTC
    5 x H  byte lengths of topic, event_type, aggregate_type, aggregate_id, schema_version
    3 x I  byte lengths of key, headers, payload
    [q     deliver_at, microseconds since 1970-01-01 UTC: only with flag 16]
    then topic, key, event_type, aggregate_type, aggregate_id, schema_version (UTF-8),
    headers (a JSON object, empty when there are none), payload (as given)

A fixed header and length-prefixed fields: one ``struct.pack`` and one join to write
(about 1 µs, docs/benchmarks.md), slices to read, and no dependency. This module is
pure (the write side imports it); the CDC relay turns a parsed envelope into the
message it publishes with ``outboxkit.cdc.envelope.decode_envelope``.
"""

from __future__ import annotations

import datetime as dt
import struct
import uuid
from typing import NamedTuple

import orjson

from outboxkit.backends.postgres.wal_sql import PREFIX, message_prefix
from outboxkit.errors import WalEnvelopeError
from outboxkit.events import Event

#: The format this module writes, and the only one it reads.
ENVELOPE_VERSION = 1

_KEY, _AGGREGATE_TYPE, _AGGREGATE_ID, _SCHEMA_VERSION, _DELIVER_AT = 1, 2, 4, 8, 16
_KNOWN_FLAGS = _KEY | _AGGREGATE_TYPE | _AGGREGATE_ID | _SCHEMA_VERSION | _DELIVER_AT
_HEAD = struct.Struct(">BB16sqHHHHHIII")
_TIME = struct.Struct(">q")
_VERSION_BYTE = bytes([ENVELOPE_VERSION])
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MICROSECOND = dt.timedelta(microseconds=1)
_EMPTY = b""

__all__ = [
    "ENVELOPE_VERSION",
    "PREFIX",
    "WalEnvelope",
    "WalEnvelopeError",
    "encode_envelope",
    "message_prefix",
    "parse_envelope",
]


class WalEnvelope(NamedTuple):
    """Every field of one envelope, as written."""

    event_id: uuid.UUID
    topic: str
    key: str | None
    event_type: str
    aggregate_type: str | None
    aggregate_id: str | None
    payload: bytes
    headers: dict[str, str]
    occurred_at: dt.datetime
    schema_version: str | None
    #: When the event may be published (``Event(deliver_at=...)``), or None: at once.
    deliver_at: dt.datetime | None


def encode_envelope(event: Event) -> bytes:
    """``event`` as one envelope (already valid: ``Event`` checks at construction)."""
    flags = 0
    topic = event.topic.encode()
    event_type = event.event_type.encode()
    key = aggregate_type = aggregate_id = schema_version = _EMPTY
    if event.key is not None:
        flags |= _KEY
        key = event.key.encode()
    if event.aggregate_type is not None:
        flags |= _AGGREGATE_TYPE
        aggregate_type = event.aggregate_type.encode()
    if event.aggregate_id is not None:
        flags |= _AGGREGATE_ID
        aggregate_id = event.aggregate_id.encode()
    if event.schema_version is not None:
        flags |= _SCHEMA_VERSION
        schema_version = event.schema_version.encode()
    headers = orjson.dumps(event.headers) if event.headers else _EMPTY
    payload = event.payload
    deliver_at = event.available_at
    if deliver_at is not None:
        flags |= _DELIVER_AT
    head = _HEAD.pack(
        ENVELOPE_VERSION,
        flags,
        event.event_id.bytes,
        (event.occurred_at - _EPOCH) // _MICROSECOND,
        len(topic),
        len(event_type),
        len(aggregate_type),
        len(aggregate_id),
        len(schema_version),
        len(key),
        len(headers),
        len(payload),
    )
    if deliver_at is not None:
        head += _TIME.pack((deliver_at - _EPOCH) // _MICROSECOND)
    return b"".join(
        (
            head,
            topic,
            key,
            event_type,
            aggregate_type,
            aggregate_id,
            schema_version,
            headers,
            payload,
        )
    )


def parse_envelope(data: bytes | bytearray | memoryview) -> WalEnvelope:
    """The fields of one envelope; :class:`WalEnvelopeError` if it is not one this version reads."""
    data = bytes(data)
    if not data:
        raise WalEnvelopeError("empty logical message: not an outboxkit envelope")
    if data[0] != ENVELOPE_VERSION:
        raise WalEnvelopeError(
            f"envelope format version {data[0]} is unknown: this outboxkit reads version"
            f" {ENVELOPE_VERSION}. A newer outboxkit wrote it: upgrade the relay to the"
            " writers' version (the event is dead-lettered, replay it after the upgrade)"
        )
    if len(data) < _HEAD.size:
        raise WalEnvelopeError(
            f"truncated envelope: {len(data)} bytes, shorter than its {_HEAD.size}-byte header"
        )
    (
        _version,
        flags,
        event_id,
        occurred_us,
        n_topic,
        n_event_type,
        n_aggregate_type,
        n_aggregate_id,
        n_schema_version,
        n_key,
        n_headers,
        n_payload,
    ) = _HEAD.unpack_from(data)
    if flags & ~_KNOWN_FLAGS:
        raise WalEnvelopeError(f"envelope has unknown flags {flags:#04x} (version 1 knows 0x1f)")
    at = _HEAD.size
    deliver_at = None
    if flags & _DELIVER_AT:
        if len(data) < at + _TIME.size:
            raise WalEnvelopeError("truncated envelope: deliver_at is missing")
        deliver_at = _time(_TIME.unpack_from(data, at)[0], "deliver_at")
        at += _TIME.size
    lengths = (n_topic, n_key, n_event_type, n_aggregate_type, n_aggregate_id, n_schema_version)
    expected = at + sum(lengths) + n_headers + n_payload
    if expected != len(data):
        raise WalEnvelopeError(
            f"malformed envelope: its field lengths add up to {expected} bytes, the message"
            f" has {len(data)}"
        )
    texts: list[str] = []
    for name, size in zip(_TEXT_FIELDS, lengths, strict=True):
        try:
            texts.append(data[at : at + size].decode())
        except UnicodeDecodeError:
            raise WalEnvelopeError(f"malformed envelope: {name} is not UTF-8") from None
        at += size
    topic, key, event_type, aggregate_type, aggregate_id, schema_version = texts
    for name, value, flag in (
        ("key", key, _KEY),
        ("aggregate_type", aggregate_type, _AGGREGATE_TYPE),
        ("aggregate_id", aggregate_id, _AGGREGATE_ID),
        ("schema_version", schema_version, _SCHEMA_VERSION),
    ):
        if value and not flags & flag:
            raise WalEnvelopeError(f"malformed envelope: {name} has bytes but its flag is unset")
    if not topic or not event_type:
        raise WalEnvelopeError("malformed envelope: topic and event_type must not be empty")
    headers = _headers(data[at : at + n_headers]) if n_headers else {}
    at += n_headers
    return WalEnvelope(
        event_id=uuid.UUID(bytes=event_id),
        topic=topic,
        key=key if flags & _KEY else None,
        event_type=event_type,
        aggregate_type=aggregate_type if flags & _AGGREGATE_TYPE else None,
        aggregate_id=aggregate_id if flags & _AGGREGATE_ID else None,
        payload=data[at:],
        headers=headers,
        occurred_at=_time(occurred_us, "occurred_at"),
        schema_version=schema_version if flags & _SCHEMA_VERSION else None,
        deliver_at=deliver_at,
    )


_TEXT_FIELDS = ("topic", "key", "event_type", "aggregate_type", "aggregate_id", "schema_version")


def _time(microseconds: int, name: str) -> dt.datetime:
    try:
        return _EPOCH + microseconds * _MICROSECOND
    except OverflowError:
        raise WalEnvelopeError(
            f"malformed envelope: {name} ({microseconds} µs since 1970) is out of range"
        ) from None


def _headers(raw: bytes) -> dict[str, str]:
    try:
        headers = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise WalEnvelopeError("malformed envelope: headers are not JSON") from None
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise WalEnvelopeError("malformed envelope: headers are not a JSON object of strings")
    return headers
