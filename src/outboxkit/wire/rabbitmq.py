"""RabbitMQ (AMQP 0-9-1): the AMQP binding, attributes as ``cloudEvents_*`` headers, UTF-8 as is.

The data content type travels as the ``content_type`` property, the event id also as
``message_id`` and ``idempotency-key``, the type also as the ``type`` property.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from outboxkit.wire.cloudevents import Envelope, Outbound

PREFIX = "cloudEvents_"
# The binding allows either separator; outboxkit sends "_" (JMS-compatible).
_PREFIXES = (PREFIX, "cloudEvents:")


def encode_headers(message: Outbound) -> dict[str, Any]:
    """Application headers: user headers, then ``idempotency-key``, then ``cloudEvents_*``.

    User headers may not shadow the dedup key or an attribute.
    """
    result: dict[str, Any] = {
        k: v
        for k, v in message.user_headers().items()
        if k != "idempotency-key" and not k.startswith(PREFIX)
    }
    result["idempotency-key"] = str(message.event_id)
    for name, value in message.cloudevents_attributes().items():
        if name != "datacontenttype":
            result[f"{PREFIX}{name}"] = value
    return result


def decode(
    body: bytes,
    headers: Mapping[str, Any] | None,
    *,
    content_type: str | None = None,
    message_type: str | None = None,
    message_id: str | None = None,
) -> Envelope:
    """The envelope of a message whose headers :func:`encode_headers` wrote.

    A native AMQP timestamp for ``time`` is accepted too, as the binding requires.
    """
    envelope = Envelope(payload=body, content_type=content_type, fallback_id=message_id)
    for name, value in (headers or {}).items():
        if isinstance(value, bytes):
            text = value.decode()
        elif isinstance(value, dt.datetime):
            text = (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).isoformat()
        else:
            text = str(value)
        if name.startswith(_PREFIXES):
            envelope.attributes[name[len(PREFIX) :]] = text
        elif name != "idempotency-key" and not name.startswith("x-"):
            envelope.headers[name] = text
    if "type" not in envelope.attributes and message_type:
        envelope.attributes["type"] = message_type
    return envelope
