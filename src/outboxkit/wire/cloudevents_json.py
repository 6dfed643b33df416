"""The CloudEvents JSON format (structured mode): the whole event in one JSON object.

For services whose records carry no headers (Kinesis) or whose events are one JSON
document (EventBridge's ``Detail``). The object holds the CloudEvents attributes
(``specversion``, ``id``, ``type``, ``source``, ``time``, ``datacontenttype``,
``subject``, ``partitionkey``, ``schemaversion``, ``traceparent``), ``headers`` (an
object of the application's headers, when there are any) and the payload: ``data``,
the payload's own JSON text embedded as it is, when the content type is JSON and the
payload parses; ``data_base64`` otherwise (binary, text, or JSON that does not parse).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson

from outboxkit.wire.cloudevents import Envelope, Outbound

_RESERVED = frozenset({"data", "data_base64", "headers"})


def encode(message: Outbound) -> bytes:
    """The event as one CloudEvents JSON object; a JSON payload's bytes are not re-encoded."""
    document: dict[str, Any] = dict(message.cloudevents_attributes())
    user = message.user_headers()
    if user:
        document["headers"] = user
    if _is_json(message.content_type) and _parses(message.payload):
        document["data"] = orjson.Fragment(message.payload)
    else:
        document["data_base64"] = base64.b64encode(message.payload).decode("ascii")
    return orjson.dumps(document)


def decode(data: bytes | str) -> Envelope:
    """The envelope of an object :func:`encode` wrote (or a dict already parsed from it).

    A ``data`` member comes back as compact JSON (byte for byte the payload ``Event()``
    wrote from a dict or list). Raises ``ValueError`` for anything that is not such an object.
    """
    try:
        document: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise ValueError("not a CloudEvents JSON object") from None
    return from_document(document)


def from_document(document: Any) -> Envelope:
    """:func:`decode` of an already parsed object (EventBridge hands ``detail`` over parsed)."""
    if not isinstance(document, dict) or "specversion" not in document:
        raise ValueError("not a CloudEvents JSON object (no specversion)")
    envelope = Envelope(payload=b"")
    for name, value in document.items():
        if name not in _RESERVED and isinstance(value, str):
            envelope.attributes[name] = value
    envelope.content_type = envelope.attributes.get("datacontenttype")
    headers = document.get("headers")
    if isinstance(headers, dict):
        envelope.headers = {str(k): str(v) for k, v in headers.items()}
    if "data_base64" in document:
        try:
            envelope.payload = base64.b64decode(str(document["data_base64"]), validate=True)
        except binascii.Error:
            raise ValueError("broken data_base64") from None
    elif "data" in document:
        envelope.payload = orjson.dumps(document["data"])
    return envelope


def _is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _parses(payload: bytes) -> bool:
    try:
        orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return True
