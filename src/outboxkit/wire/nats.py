"""NATS JetStream: the NATS binding's percent-encoded ``ce-*`` headers, ``Nats-Msg-Id`` = event id.

JetStream drops a message whose ``Nats-Msg-Id`` it saw within the stream's duplicate
window, which is what makes a re-published batch harmless on NATS.
"""

from __future__ import annotations

from collections.abc import Mapping

from outboxkit.wire.cloudevents import Envelope, Outbound, encode_header_value, split_ce_headers

MSG_ID = "Nats-Msg-Id"


def encode_headers(message: Outbound) -> dict[str, str]:
    """User headers, then ``content-type``, the ``ce-*`` attributes and ``Nats-Msg-Id``.

    User headers come first, so they cannot override the dedup id or an attribute. The
    binding maps every attribute to ``ce-<attr>``, datacontenttype included;
    ``content-type`` stays for readers of earlier versions.
    """
    headers = message.user_headers()
    content_type = message.content_type
    headers["content-type"] = content_type
    headers.update(message.cloudevents_headers())
    headers["ce-datacontenttype"] = encode_header_value(content_type)
    headers[MSG_ID] = str(message.event_id)
    return headers


def decode(data: bytes, headers: Mapping[str, str] | None) -> Envelope:
    """The envelope of a message written by :func:`encode_headers`.

    Raises ``ValueError`` when an attribute's percent-encoded bytes are not UTF-8.
    """
    attributes, user, content_type = split_ce_headers(headers or {}, skip_prefix="Nats-")
    return Envelope(
        payload=data,
        attributes=attributes,
        headers=user,
        content_type=attributes.get("datacontenttype") or content_type,
        fallback_id=(headers or {}).get(MSG_ID),
    )


# "NATS/1.0\r\n" opens a header block, "\r\n" ends it; each header is "name: value\r\n".
_HEADER_BLOCK = 12
_PER_HEADER = 4


def message_size(payload: bytes, headers: Mapping[str, str]) -> int:
    """Bytes the server counts against its ``max_payload``: the header block and the payload.

    Counted as nats-py encodes them (names and values stripped, UTF-8): the server drops
    the whole connection over a message one byte too large, so the count is exact.
    """
    size = len(payload) + _HEADER_BLOCK
    for name, value in headers.items():
        size += len(name.strip()) + len(value.strip().encode()) + _PER_HEADER
    return size


def oversize(payload: bytes, headers: Mapping[str, str], limit: int) -> int | None:
    """:func:`message_size` when it is over ``limit``, else None.

    Every event pays this check: a character is at most 4 UTF-8 bytes, so most messages
    are cleared without encoding anything.
    """
    chars = sum(map(len, headers)) + sum(map(len, headers.values()))
    if len(payload) + _HEADER_BLOCK + _PER_HEADER * len(headers) + 4 * chars <= limit:
        return None
    size = message_size(payload, headers)
    return size if size > limit else None
