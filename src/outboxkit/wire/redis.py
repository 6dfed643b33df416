"""Redis Streams: one entry per event, fields ``data``, ``ce_<attr>`` and ``headers`` (JSON)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from outboxkit.wire.cloudevents import Envelope, Outbound

PREFIX = "ce_"


def encode(message: Outbound) -> dict[str, bytes | str]:
    """The entry's fields: payload bytes, every attribute, user headers when there are any."""
    fields: dict[str, bytes | str] = {"data": message.payload}
    for name, value in message.cloudevents_attributes().items():
        fields[f"{PREFIX}{name}"] = value
    user = message.user_headers()
    if user:
        fields["headers"] = orjson.dumps(user)
    return fields


def decode(fields: Mapping[Any, Any]) -> Envelope:
    """The envelope of an entry :func:`encode` wrote (names and values as str or bytes).

    Raises ``ValueError`` when the ``headers`` field is not JSON.
    """
    envelope = Envelope(payload=b"")
    for raw_name, value in fields.items():
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        if name == "data":
            envelope.payload = value if isinstance(value, bytes) else str(value).encode()
        elif name.startswith(PREFIX):
            text = value.decode() if isinstance(value, bytes) else str(value)
            envelope.attributes[name[len(PREFIX) :]] = text
        elif name == "headers":
            try:
                decoded = orjson.loads(value)
            except orjson.JSONDecodeError:
                raise ValueError("unreadable headers (not JSON)") from None
            if isinstance(decoded, dict):
                envelope.headers = {str(k): str(v) for k, v in decoded.items()}
    return envelope
