"""Webhooks: the CloudEvents HTTP binding (percent-encoded ``ce-*`` headers), Standard Webhooks.

The body is the payload; ``content-type`` its data content type; ``webhook-id`` and
``Idempotency-Key`` the event id. The publisher adds ``webhook-timestamp`` and the
``webhook-signature`` over id, timestamp and body.
"""

from __future__ import annotations

from collections.abc import Mapping

from outboxkit.wire.cloudevents import Envelope, Outbound, split_ce_headers

#: Headers the transport owns: a user header of that name is not sent.
RESERVED = frozenset(
    {
        "content-type",
        "idempotency-key",
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "content-length",
        "host",
        "transfer-encoding",
    }
)
# What an HTTP client adds on its own: not the application's headers when reading back.
_TRANSPORT = RESERVED | {"accept", "accept-encoding", "connection", "user-agent"}


def encode_headers(message: Outbound) -> dict[str, str]:
    """User headers (not reserved, not ``ce-*``), ``content-type``, ``ce-*``, the event id."""
    headers = {
        k: v
        for k, v in message.user_headers().items()
        if k.lower() not in RESERVED and not k.lower().startswith("ce-")
    }
    headers["content-type"] = message.content_type
    headers.update(message.cloudevents_headers())  # percent-encoded (HTTP binding)
    event_id = str(message.event_id)
    headers["Idempotency-Key"] = event_id
    headers["webhook-id"] = event_id
    return headers


def decode(body: bytes, headers: Mapping[str, str]) -> Envelope:
    """The envelope of a request :func:`encode_headers` described.

    Raises ``ValueError`` when an attribute's percent-encoded bytes are not UTF-8.
    """
    attributes, user, content_type = split_ce_headers(headers, skip=_TRANSPORT)
    return Envelope(
        payload=body,
        attributes=attributes,
        headers=user,
        content_type=content_type,
        fallback_id=headers.get("webhook-id"),
    )
