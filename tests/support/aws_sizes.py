"""Messages sized to an AWS limit to the byte, for the SNS, Kinesis and EventBridge tests."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from outboxkit import Event
from outboxkit.events import new_event_id
from outboxkit.publishers.base import OutboundMessage


def outbound(
    payload: bytes, *, topic: str = "orders", key: str | None = "customer-1"
) -> OutboundMessage:
    """An event as the relay hands it over (JSON content type, one user header)."""
    now = dt.datetime.now(dt.UTC)
    return OutboundMessage(
        event_id=new_event_id(),
        topic=topic,
        key=key,
        event_type="file.stored",
        aggregate_type="file",
        aggregate_id="1",
        payload=payload,
        headers={"tenant": "acme"},
        created_at=now,
        occurred_at=now,
    )


def json_string(size: int) -> bytes:
    """A JSON document (one string) of exactly ``size`` bytes."""
    return b'"' + b"x" * (size - 2) + b'"'


def at_limit(
    size_of: Callable[[OutboundMessage], int], limit: int, over: int = 0
) -> OutboundMessage:
    """A message whose size as ``size_of`` counts it is ``limit + over`` bytes.

    The service's count grows byte for byte with a JSON string payload, so the overhead is
    measured on a two-byte one.
    """
    overhead = size_of(outbound(json_string(2))) - 2
    message = outbound(json_string(limit + over - overhead))
    assert size_of(message) == limit + over
    return message


def outbound_of(event: Event) -> OutboundMessage:
    """``event`` as a relay hands it to a publisher (to publish it again by hand)."""
    return OutboundMessage(
        event_id=event.event_id,
        topic=event.topic,
        key=event.key,
        event_type=event.event_type,
        aggregate_type=event.aggregate_type,
        aggregate_id=event.aggregate_id,
        payload=event.payload,
        headers=dict(event.headers),
        created_at=dt.datetime.now(dt.UTC),
        occurred_at=event.occurred_at,
    )
