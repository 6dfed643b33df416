"""What every broker's wire format shares: the decoded envelope and the ``ce-*`` header binding.

Attribute values in ``ce-*`` headers use the HTTP and NATS percent-encoding:

Both bindings (HTTP 1.0.2 §3.1.3.2, NATS §3.1.3.2) carry attributes as
headers limited to printable ASCII, so a value's space, ``"``, ``%`` and every
character outside U+0021..U+007E are sent as ``%XX`` of their UTF-8 bytes.
The Kafka and AMQP bindings carry UTF-8 strings as they are and must not be
encoded: ``100%41`` there is the attribute ``100%41``.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import quote, unquote


class Outbound(Protocol):
    """The event as a publisher sends it (``publishers.base.OutboundMessage``).

    A protocol, so that consumers can import the wire formats without the publishers.
    """

    @property
    def event_id(self) -> uuid.UUID: ...
    @property
    def topic(self) -> str: ...
    @property
    def key(self) -> str | None: ...
    @property
    def event_type(self) -> str: ...
    @property
    def aggregate_type(self) -> str | None: ...
    @property
    def aggregate_id(self) -> str | None: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def headers(self) -> dict[str, str]: ...
    @property
    def schema_version(self) -> str | None: ...
    @property
    def content_type(self) -> str: ...
    @property
    def time(self) -> dt.datetime: ...
    def cloudevents_attributes(self) -> dict[str, str]: ...
    def cloudevents_headers(self) -> dict[str, str]: ...
    def user_headers(self) -> dict[str, str]: ...


@dataclass(slots=True)
class Envelope:
    """A broker message taken apart: CloudEvents attributes (no prefix), headers, payload.

    ``fallback_id`` is the broker's own message id, used when the ``id`` attribute is
    missing; ``key`` and ``content_type`` are the broker's native ones, if it has them.
    """

    payload: bytes
    attributes: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    key: str | None = None
    content_type: str | None = None
    fallback_id: str | None = None


# Printable ASCII except space, double quote and percent: sent as is.
_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')
_NEEDS_ENCODING = re.compile(r"[^\x21\x23\x24\x26-\x7e]")
_QUOTED_PAIR = re.compile(r"\\(.)")


def encode_header_value(value: str) -> str:
    """Percent-encode ``value`` for a ``ce-*`` header (upper-case hex, UTF-8 bytes)."""
    if _NEEDS_ENCODING.search(value) is None:
        return value  # the common case: ids, types, times, plain ASCII subjects
    return quote(value, safe=_SAFE, encoding="utf-8", errors="strict")


def decode_header_value(value: str) -> str:
    """The attribute in a ``ce-*`` header: unquote a quoted-string, then one percent-decoding.

    Raises ``ValueError`` for percent-encoded bytes that are not UTF-8 (the
    bindings require rejecting them, e.g. the overlong ``%C0%A0``).
    """
    if len(value) >= 2 and value[0] == value[-1] == '"':
        # Older senders may quote the value (RFC 7230 §3.2.6 quoted-string).
        value = _QUOTED_PAIR.sub(r"\1", value[1:-1])
    if "%" not in value:
        return value
    try:
        return unquote(value, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise ValueError(
            f"header value {value!r} percent-encodes bytes that are not UTF-8"
        ) from None


def split_ce_headers(
    headers: Mapping[str, str], skip: frozenset[str] = frozenset(), skip_prefix: str = "\0"
) -> tuple[dict[str, str], dict[str, str], str | None]:
    """``ce-*`` headers decoded into attributes; the rest as user headers; ``content-type``.

    Names in ``skip`` (lower case) or starting with ``skip_prefix`` are the transport's,
    not the application's. Raises ``ValueError`` naming a header whose value does not decode.
    """
    attributes: dict[str, str] = {}
    user: dict[str, str] = {}
    content_type = None
    for name, value in headers.items():
        lowered = name.lower()
        if lowered.startswith("ce-"):
            try:
                attributes[lowered[3:]] = decode_header_value(value)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        elif lowered == "content-type":
            content_type = value
        elif lowered not in skip and not name.startswith(skip_prefix):
            user[name] = value
    return attributes, user, content_type
