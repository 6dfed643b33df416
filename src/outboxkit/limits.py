"""Sizes, counts and characters every event field must respect, checked where it is built.

One module both sides read: ``Event`` refuses a bad field at construction (in the
caller's code, before anything reaches the database), the store dead-letters a row
written around that check (plain SQL, an older version) before the relay loads it,
and each publisher checks again for its broker's own rules.

Why these numbers:

* ``topic``, ``event_type``, ``aggregate_type``: 255 bytes — a RabbitMQ routing key
  and the AMQP ``type`` property are short strings of at most 255 bytes, Kafka topic
  names stop at 249 characters; a destination or a type name never needs more.
* ``key``: 1 KiB by default (``Outbox(max_key_bytes=…)``, up to 64 KiB) — an
  aggregate id or a composite partition key; a key travels in every header set and
  every partitioner hash, so a large one costs on each hop.
* ``aggregate_id``: 1 KiB, like the key it usually is.
* headers: 64 entries, names of up to 128 bytes, values of up to 8 KiB — HTTP
  servers refuse header sections beyond 8 to 16 KiB per line, NATS and Kafka carry
  them in every message; an application's metadata fits easily.
* ``put_many``: 10 000 events per call — one statement carries them all as arrays;
  write larger sets in several calls, each in the same transaction if they must
  commit together.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from outboxkit.errors import InvalidEventError

MAX_TOPIC_BYTES = 255
MAX_EVENT_TYPE_BYTES = 255
MAX_AGGREGATE_TYPE_BYTES = 255
MAX_AGGREGATE_ID_BYTES = 1024
#: ``Outbox(max_key_bytes=…)``'s default; the ceiling any Outbox may raise it to.
DEFAULT_MAX_KEY_BYTES = 1024
MAX_KEY_BYTES = 64 * 1024
MAX_HEADERS = 64
MAX_HEADER_NAME_BYTES = 128
MAX_HEADER_VALUE_BYTES = 8 * 1024
#: Events one ``put_many``/``execute_with`` call takes.
MAX_BATCH_EVENTS = 10_000

#: What the relay loads of a row, at most (the store dead-letters a row over it at
#: claim time, before it reaches the relay's memory): any text column, and the
#: headers as JSON text. Generous bounds on rows written around ``Event``, not the
#: write-time limits above, so nothing an ``Event`` accepts is ever refused here.
STORE_MAX_TEXT_BYTES = MAX_KEY_BYTES
STORE_MAX_HEADERS_BYTES = 1024 * 1024

# Characters refused in text fields: C0 controls (NUL, CR, LF, ...) and DEL. A header
# value may hold a tab, as HTTP allows; a topic may hold no whitespace at all.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HEADER_VALUE_BAD = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_TOPIC_BAD = re.compile(r"[\x00-\x20\x7f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")
# RFC 7230 token: what HTTP, NATS and every binding accept as a header name.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

#: Header names outboxkit or a broker gives a meaning to (compared lower-cased): an
#: application header of that name would forge the dedup id (``Nats-Msg-Id``,
#: ``idempotency-key``), a CloudEvents attribute, a webhook signature, or make the
#: broker act (``Nats-Rollup`` purges a subject, ``Nats-Expected-*`` fences it).
RESERVED_HEADER_PREFIXES = ("nats-", "ce-", "ce_", "cloudevents_", "webhook-")
RESERVED_HEADER_NAMES = frozenset(
    {"idempotency-key", "content-length", "transfer-encoding", "host", "connection"}
)


def text_problem(name: str, value: str, max_bytes: int) -> str | None:
    """Why ``value`` cannot be the event's ``name`` field, or None."""
    # Fast path (every event pays it): a UTF-8 character is at most 4 bytes, and a
    # printable string holds no control character.
    if len(value) * 4 > max_bytes:
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            return f"{name} is {size} bytes, over the limit of {max_bytes}"
    if not value.isprintable() and _CONTROL.search(value):
        return f"{name} contains a control character (NUL, CR, LF, ...): {_excerpt(value)}"
    return None


def topic_problem(topic: str) -> str | None:
    """Why ``topic`` cannot be a destination on any broker, or None."""
    if not topic:
        return "topic is empty"
    problem = text_problem("topic", topic, MAX_TOPIC_BYTES)
    # Every whitespace character but the ASCII space is also not printable.
    if problem is None and (" " in topic or not topic.isprintable()) and _TOPIC_BAD.search(topic):
        problem = f"topic contains whitespace: {_excerpt(topic)}"
    return problem


def header_problem(name: str, value: str) -> str | None:
    """Why ``name: value`` cannot travel as a header on every broker, or None."""
    if len(value) * 4 > MAX_HEADER_VALUE_BYTES:
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > MAX_HEADER_VALUE_BYTES:
            return f"header {name!r} is {size} bytes, over the limit of {MAX_HEADER_VALUE_BYTES}"
    return wire_header_problem(name, value)


def wire_header_problem(name: str, value: str) -> str | None:
    """Why ``name: value`` would break a header line (any size), or None.

    What a publisher checks before sending: a CR, LF or NUL in a value, or a name
    that is not a token, would end the header line and let the event write the next.
    """
    problem = _name_verdict(name)[0]
    if problem is not None:
        return problem
    if not value.isprintable() and _HEADER_VALUE_BAD.search(value):
        return f"header {name!r} contains a control character (NUL, CR, LF, ...): {_excerpt(value)}"
    return None


def is_reserved_header(name: str) -> bool:
    """True for a name outboxkit or a broker interprets (see ``RESERVED_HEADER_*``)."""
    return _name_verdict(name)[1]


def wire_headers_problem(headers: Mapping[str, str]) -> str | None:
    """:func:`wire_header_problem` of each header, or None."""
    for name, value in headers.items():
        if (problem := wire_header_problem(name, value)) is not None:
            return problem
    return None


# Header names repeat from event to event: each is judged once (a bounded cache).
_NAME_VERDICTS: dict[str, tuple[str | None, bool]] = {}
_NAME_VERDICTS_MAX = 4096


def _name_verdict(name: str) -> tuple[str | None, bool]:
    """``(why the name is not a valid header name or None, whether it is reserved)``."""
    verdict = _NAME_VERDICTS.get(name)
    if verdict is None:
        problem: str | None = None
        if len(name.encode("utf-8", "surrogatepass")) > MAX_HEADER_NAME_BYTES:
            problem = f"header name {_excerpt(name)} is over {MAX_HEADER_NAME_BYTES} bytes"
        elif not _TOKEN.fullmatch(name):
            problem = (
                f"header name {_excerpt(name)} is not an HTTP token"
                " (letters, digits and !#$%&'*+-.^_`|~ only)"
            )
        lowered = name.lower()
        reserved = lowered in RESERVED_HEADER_NAMES or lowered.startswith(RESERVED_HEADER_PREFIXES)
        verdict = (problem, reserved)
        if len(_NAME_VERDICTS) >= _NAME_VERDICTS_MAX:
            _NAME_VERDICTS.clear()
        _NAME_VERDICTS[name] = verdict
    return verdict


def headers_problem(headers: Mapping[str, str], *, allow_reserved: bool = False) -> str | None:
    """Why ``headers`` cannot travel with an event, or None (count, names, values)."""
    if len(headers) > MAX_HEADERS:
        return f"{len(headers)} headers, over the limit of {MAX_HEADERS}"
    for name, value in headers.items():
        problem = header_problem(name, value)
        if problem is not None:
            return problem
        if not allow_reserved and is_reserved_header(name):
            return (
                f"header {name!r} is reserved: outboxkit or the broker sets or interprets it"
                " (Nats-*, ce-*/ce_*, cloudEvents_*, webhook-*, idempotency-key and HTTP"
                " framing headers); rename it, e.g. 'x-app-" + name.lower() + "'"
            )
    return None


def too_many_events() -> InvalidEventError:
    """The error for a batch over ``MAX_BATCH_EVENTS``, with what to do instead."""
    return InvalidEventError(
        f"more than {MAX_BATCH_EVENTS} events in one put_many call: one statement carries"
        " them all in memory on both sides; write them in chunks of at most"
        f" {MAX_BATCH_EVENTS} (several put_many calls in the same transaction if they"
        " must commit together)"
    )


def _excerpt(value: str, limit: int = 60) -> str:
    """A short, printable rendering of a refused value (for error messages and logs)."""
    text = repr(value[:limit])
    return text + (f"… ({len(value)} characters)" if len(value) > limit else "")
