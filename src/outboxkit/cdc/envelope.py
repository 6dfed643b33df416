"""A WAL-only event (``Outbox(storage="wal")``) as the message the relay publishes.

The format lives in ``outboxkit.write.wal_envelope`` (the write side encodes with it and
must not import the publishers); this is the relay's end of it.
"""

from __future__ import annotations

import datetime as dt

from outboxkit.publishers.base import OutboundMessage
from outboxkit.write.wal_envelope import WalEnvelopeError, parse_envelope

__all__ = ["WalEnvelopeError", "decode_envelope"]


def decode_envelope(
    data: bytes | bytearray | memoryview, *, commit_time: dt.datetime
) -> OutboundMessage:
    """The event of one logical message, first attempt; ``commit_time`` is its ``created_at``.

    Raises :class:`WalEnvelopeError` for an unknown version or a malformed envelope
    (the relay dead-letters it). ``deliver_at`` is not part of the message: read it
    with ``parse_envelope`` where it matters.
    """
    env = parse_envelope(data)
    return OutboundMessage(
        event_id=env.event_id,
        topic=env.topic,
        key=env.key,
        event_type=env.event_type,
        aggregate_type=env.aggregate_type,
        aggregate_id=env.aggregate_id,
        payload=env.payload,
        headers=env.headers,
        created_at=commit_time,
        attempt=1,
        occurred_at=env.occurred_at,
        schema_version=env.schema_version,
    )
