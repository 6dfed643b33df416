"""CloudEvents attribute values in ``ce-*`` headers: the HTTP and NATS percent-encoding.

Both bindings (HTTP 1.0.2 §3.1.3.2, NATS §3.1.3.2) carry attributes as
headers limited to printable ASCII, so a value's space, ``"``, ``%`` and every
character outside U+0021..U+007E are sent as ``%XX`` of their UTF-8 bytes.
The Kafka and AMQP bindings carry UTF-8 strings as they are and must not be
encoded: ``100%41`` there is the attribute ``100%41``.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

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
