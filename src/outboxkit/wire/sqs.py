"""Amazon SQS: the body is the payload, the metadata at most 10 String message attributes.

Attributes: ``ce_id``, ``ce_type``, ``ce_source``, ``ce_time``, ``ce_specversion``,
``content-type``, ``ce_subject`` and ``ce_partitionkey`` when present, ``headers``
(JSON of user headers) when there are any, ``content-transfer-encoding: base64`` when
the body had to be encoded, and ``ce_schemaversion`` when the event has one (inside
``headers`` when the other nine are all present).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from typing import Any

import orjson

from outboxkit.wire.cloudevents import Envelope, Outbound

PREFIX = "ce_"
MAX_ATTRIBUTES = 10  # message attributes SQS accepts per message
# Characters SQS accepts in a message body (XML 1.0 characters).
_SQS_TEXT = re.compile("^[\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*$")


def encode(message: Outbound) -> tuple[str, dict[str, str]]:
    """The message body (the payload, base64 unless SQS accepts it as text) and its attributes."""
    try:
        body = message.payload.decode("utf-8")
        encoded = _SQS_TEXT.match(body) is None
    except UnicodeDecodeError:
        encoded = True
    if encoded:
        body = base64.b64encode(message.payload).decode("ascii")
    return body, _attributes(message, base64_body=encoded)


def _attributes(message: Outbound, *, base64_body: bool) -> dict[str, str]:
    ce = message.cloudevents_attributes()
    attributes = {
        "ce_id": ce["id"],
        "ce_type": ce["type"],
        "ce_source": ce["source"],
        "ce_time": ce["time"],
        "ce_specversion": ce["specversion"],
        "content-type": ce["datacontenttype"],
    }
    for name in ("subject", "partitionkey"):
        if name in ce:
            attributes[f"{PREFIX}{name}"] = ce[name]
    user = message.user_headers()
    version = ce.get("schemaversion")
    if version is not None:
        if len(attributes) + bool(user) + base64_body < MAX_ATTRIBUTES:
            attributes["ce_schemaversion"] = version
        else:
            # All ten attributes taken: the version rides in the headers object.
            user = {**user, "ce_schemaversion": version}
    if user:
        attributes["headers"] = orjson.dumps(user).decode()
    if base64_body:
        attributes["content-transfer-encoding"] = "base64"
    return attributes


def decode(body: str, attributes: Mapping[str, str]) -> Envelope:
    """The envelope of a message :func:`encode` wrote (attribute names to string values).

    Raises ``ValueError`` for unreadable ``headers`` or a broken base64 body.
    """
    envelope = Envelope(payload=b"")
    base64_body = False
    for name, text in attributes.items():
        if name.startswith(PREFIX):
            envelope.attributes[name[len(PREFIX) :]] = text
        elif name == "content-type":
            envelope.content_type = text
        elif name == "content-transfer-encoding":
            base64_body = text == "base64"
        elif name == "headers":
            try:
                decoded: Any = orjson.loads(text)
            except orjson.JSONDecodeError:
                raise ValueError("unreadable headers (not JSON)") from None
            if isinstance(decoded, dict):
                envelope.headers = {str(k): str(v) for k, v in decoded.items()}
    if "ce_schemaversion" in envelope.headers:  # no attribute slot was left for it
        envelope.attributes.setdefault("schemaversion", envelope.headers.pop("ce_schemaversion"))
    if base64_body:
        try:
            envelope.payload = base64.b64decode(body, validate=True)
        except binascii.Error:
            raise ValueError("broken base64 body") from None
    else:
        envelope.payload = body.encode("utf-8")
    return envelope
