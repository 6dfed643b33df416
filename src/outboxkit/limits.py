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
#: Headers ``Event`` adds to the application's (``traceparent``, ``tracestate``,
#: ``content-type``): a stored event may carry this many more than ``MAX_HEADERS``.
ADDED_HEADERS = 3
#: Longest ``schema_version``: a version label ("3", "2.1", "2024-06-01"), not a schema.
MAX_SCHEMA_VERSION_CHARS = 64
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
# A lone surrogate (U+D800..U+DFFF) is no character: UTF-8 cannot encode it, so the
# database driver would fail at ``put``, after the caller's transaction did its work.
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_TOPIC_BAD = re.compile(r"[\x00-\x20\x7f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")
# RFC 7230 token: what HTTP, NATS and every binding accept as a header name.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

#: Header names outboxkit or a broker gives a meaning to (compared lower-cased): an
#: application header of that name would forge the dedup id or a CloudEvents attribute,
#: sign a webhook, or make a broker or its clients act. By broker:
#:
#: * NATS: ``Nats-*`` (the server acts on them: ``Nats-Msg-Id`` dedups, ``Nats-Rollup``
#:   purges a subject, ``Nats-Expected-*`` fence, ``Nats-TTL``, ``Nats-Schedule*``, ...);
#:   ``Status`` and ``Description``, where the clients put a server status line (a stored
#:   message carrying ``Status: 404`` reads as "no messages" to nats-py's fetch, ``500``
#:   as an error); ``KV-Operation`` (a KV watcher reads ``DEL``/``PURGE`` as a deletion).
#: * RabbitMQ: ``CC``/``BCC`` route the message to more queues (sender-selected
#:   distribution; a string value closes the channel); ``x-death`` and the
#:   ``x-first-death-*``/``x-last-death-*`` headers are the broker's dead-letter history,
#:   ``x-delivery-count`` its redelivery count, ``x-received-from`` the federation and
#:   shovel loop guard.
#: * HTTP (webhooks): the framing and hop-by-hop headers (``Content-Length``,
#:   ``Transfer-Encoding``, ``Host``, ``Connection``, ``Keep-Alive``, ``TE``,
#:   ``Trailer``, ``Upgrade``, ``Expect``, ``Proxy-*``), and ``webhook-*``.
#: * every binding: ``ce-*``, ``ce_*``, ``cloudEvents_*`` and ``idempotency-key``.
#:
#: Kafka, Redis and SQS give header names no meaning: outboxkit's own are all it reserves.
RESERVED_HEADER_PREFIXES = ("nats-", "ce-", "ce_", "cloudevents_", "webhook-", "proxy-")
RESERVED_HEADER_NAMES = frozenset(
    {
        "idempotency-key",
        # NATS
        "status",
        "description",
        "kv-operation",
        # RabbitMQ
        "cc",
        "bcc",
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
        "x-delivery-count",
        "x-received-from",
        # HTTP framing and hop-by-hop (RFC 9110 7.6.1)
        "content-length",
        "transfer-encoding",
        "host",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
    }
)

#: Topic prefixes naming a broker's own machinery, refused whatever the broker: NATS
#: subjects beginning with ``$`` are its system API (``$JS.API.STREAM.DELETE.X`` deletes a
#: stream, ``$SYS.`` server events, ``$KV.`` and ``$O.`` the stores) and ``_INBOX.`` the
#: reply subjects of other clients' requests. Kafka refuses ``$`` in a topic anyway; on
#: the others no honest topic begins with either. A deployment that needs one says so
#: twice: ``Event(allow_system_topic=True)`` and the publisher's ``allow_system=`` option.
SYSTEM_TOPIC_PREFIXES = ("$", "_INBOX.")


def text_problem(name: str, value: str, max_bytes: int) -> str | None:
    """Why ``value`` cannot be the event's ``name`` field, or None."""
    # Fast path (every event pays it): a UTF-8 character is at most 4 bytes, and a
    # printable string holds no control character.
    if len(value) * 4 > max_bytes:
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            return f"{name} is {size} bytes, over the limit of {max_bytes}"
    if not value.isprintable():
        if _CONTROL.search(value):
            return f"{name} contains a control character (NUL, CR, LF, ...): {_excerpt(value)}"
        if _SURROGATE.search(value):
            return f"{name} contains a lone surrogate (not encodable as UTF-8): {_excerpt(value)}"
    return None


def topic_problem(topic: str, *, allow_system: bool = False) -> str | None:
    """Why ``topic`` cannot be a destination on any broker, or None.

    ``allow_system`` lets a topic in ``SYSTEM_TOPIC_PREFIXES`` through (the other rules hold).
    """
    # Topics repeat from event to event: each is judged once (a bounded cache).
    problem = _TOPIC_VERDICTS.get(topic, _UNSEEN)
    if problem is _UNSEEN:
        if not topic or topic.isspace():
            problem = "topic is empty"
        else:
            problem = text_problem("topic", topic, MAX_TOPIC_BYTES)
        # Every whitespace character but the ASCII space is also not printable.
        if (
            problem is None
            and (" " in topic or not topic.isprintable())
            and _TOPIC_BAD.search(topic)
        ):
            problem = f"topic contains whitespace: {_excerpt(topic)}"
        if len(topic) <= MAX_TOPIC_BYTES:  # a row's oversized topic is judged, not kept
            if len(_TOPIC_VERDICTS) >= _NAME_VERDICTS_MAX:
                _TOPIC_VERDICTS.clear()
            _TOPIC_VERDICTS[topic] = problem
    if problem is None and not allow_system and topic.startswith(SYSTEM_TOPIC_PREFIXES):
        problem = (
            f"topic {_excerpt(topic)} is a system destination ('$...' subjects are the NATS"
            " server's API: $JS. JetStream, $SYS., $KV., $O.; '_INBOX.' are reply subjects of"
            " other clients); name the destination otherwise, or allow it explicitly with"
            " Event(allow_system_topic=True) and the publisher's allow_system= option"
        )
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
    if not value.isprintable():
        if _HEADER_VALUE_BAD.search(value):
            return (
                f"header {name!r} contains a control character (NUL, CR, LF, ...):"
                f" {_excerpt(value)}"
            )
        if _SURROGATE.search(value):
            return (
                f"header {name!r} contains a lone surrogate (not encodable as UTF-8):"
                f" {_excerpt(value)}"
            )
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
_TOPIC_VERDICTS: dict[str, str | None] = {}
_UNSEEN = "unseen"


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
        if len(name) <= MAX_HEADER_NAME_BYTES:  # a row's oversized name is judged, not kept
            if len(_NAME_VERDICTS) >= _NAME_VERDICTS_MAX:
                _NAME_VERDICTS.clear()
            _NAME_VERDICTS[name] = verdict
    return verdict


def headers_problem(
    headers: Mapping[str, str], *, allow_reserved: bool = False, max_headers: int = MAX_HEADERS
) -> str | None:
    """Why ``headers`` cannot travel with an event, or None (count, names, values)."""
    if len(headers) > max_headers:
        return f"{len(headers)} headers, over the limit of {max_headers}"
    for name, value in headers.items():
        # The common header (a known name, a short printable value) costs two lookups.
        verdict = _NAME_VERDICTS.get(name) or _name_verdict(name)
        if verdict[0] is not None:
            return verdict[0]
        if len(value) * 4 > MAX_HEADER_VALUE_BYTES or not value.isprintable():
            problem = header_problem(name, value)
            if problem is not None:
                return problem
        if verdict[1] and not allow_reserved:
            return (
                f"header {name!r} is {reserved_header_reason(name)}; rename it,"
                f" e.g. 'x-app-{name.lower()}'"
            )
    return None


def reserved_header_reason(name: str) -> str:
    """Who reserves the header ``name`` and why, as a phrase ("reserved by NATS (...)")."""
    lowered = name.lower()
    if lowered.startswith("nats-"):
        return (
            "reserved by NATS (the server acts on Nats-* headers: dedup ids, rollups,"
            " expected sequences, TTLs)"
        )
    if lowered in ("status", "description"):
        return (
            "reserved by NATS (its clients read a server status from Status and Description:"
            " a message carrying them is taken for 'no messages' or an error and never handled)"
        )
    if lowered == "kv-operation":
        return "reserved by NATS (a key-value watcher reads it as a deletion)"
    if lowered in ("cc", "bcc"):
        return "reserved by RabbitMQ (CC and BCC route the message to more queues)"
    if lowered.startswith("x-"):
        return (
            "reserved by RabbitMQ (the broker sets it: dead-letter history, delivery count,"
            " federation loop guard)"
        )
    if lowered.startswith(("ce-", "ce_", "cloudevents_")):
        return (
            "reserved by outboxkit (a CloudEvents attribute header: it would forge the"
            " event's id, type, source or time)"
        )
    if lowered.startswith("webhook-") or lowered == "idempotency-key":
        return "reserved by outboxkit (the event id and the webhook signature)"
    return "reserved by HTTP (a framing or hop-by-hop header: a webhook request cannot carry it)"


def event_problem(
    topic: str,
    event_type: str,
    key: str | None = None,
    aggregate_type: str | None = None,
    aggregate_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    schema_version: str | None = None,
    max_key_bytes: int = MAX_KEY_BYTES,
    max_headers: int = MAX_HEADERS,
    allow_system_topic: bool = False,
) -> str | None:
    """Why these fields cannot make an event, or None: the one set of rules.

    ``Event()`` applies it when it is built (after its type checks), and every publisher
    again to what the relay claimed, so a row written around ``Event()`` (plain SQL, an
    older version) is refused by the same rules (``max_headers`` then counts the headers
    ``Event`` adds: ``MAX_HEADERS + ADDED_HEADERS``). Every relayed event pays it: the
    common event (a known topic, short printable fields) takes the fast path.
    """
    if _TOPIC_VERDICTS.get(topic, _UNSEEN) is not None or topic[:1] in "$_":
        problem = topic_problem(topic, allow_system=allow_system_topic)
        if problem is not None:
            return problem
    if not event_type or event_type.isspace():
        return "event_type is empty"
    if len(event_type) * 4 > MAX_EVENT_TYPE_BYTES or not event_type.isprintable():
        problem = text_problem("event_type", event_type, MAX_EVENT_TYPE_BYTES)
        if problem is not None:
            return problem
    # (Three plain ifs: a loop over a tuple of them costs a third of the fast path.)
    if key is not None and (len(key) * 4 > max_key_bytes or not key.isprintable()):
        problem = text_problem("key", key, max_key_bytes)
        if problem is not None:
            return problem
    if aggregate_type is not None and (
        len(aggregate_type) * 4 > MAX_AGGREGATE_TYPE_BYTES or not aggregate_type.isprintable()
    ):
        problem = text_problem("aggregate_type", aggregate_type, MAX_AGGREGATE_TYPE_BYTES)
        if problem is not None:
            return problem
    if aggregate_id is not None and (
        len(aggregate_id) * 4 > MAX_AGGREGATE_ID_BYTES or not aggregate_id.isprintable()
    ):
        problem = text_problem("aggregate_id", aggregate_id, MAX_AGGREGATE_ID_BYTES)
        if problem is not None:
            return problem
    if headers:
        problem = headers_problem(headers, max_headers=max_headers)
        if problem is not None:
            return problem
    if schema_version is not None and (
        not 0 < len(schema_version) <= MAX_SCHEMA_VERSION_CHARS or not schema_version.isprintable()
    ):
        return (
            f"schema_version {_excerpt(schema_version)} is not 1 to"
            f" {MAX_SCHEMA_VERSION_CHARS} printable characters"
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
