"""What every publisher refuses before sending: ``Event()``'s rules and its broker's system names.

Rows written around ``Event()`` (plain SQL, an older version) and topics rewritten by
routes reach the relay too. Each publisher asks its :class:`Guard` about every message
and dead-letters a refused one at once, with the reason, without sending it: a topic
must not reach the broker's own machinery (``$JS.API.STREAM.DELETE.X`` deletes a
stream) and a header must not be one the broker acts on. A deployment that really
publishes to a system destination names it: ``allow_system=GLOB,...`` in the broker URL
(``publishers.from_url``) or ``allow_system_destinations(publisher, globs)``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from urllib.parse import unquote_plus

from outboxkit.errors import ConfigurationError
from outboxkit.limits import (
    ADDED_HEADERS,
    MAX_AGGREGATE_ID_BYTES,
    MAX_HEADER_VALUE_BYTES,
    MAX_HEADERS,
    MAX_KEY_BYTES,
    event_problem,
)
from outboxkit.publishers.base import OutboundMessage, PublishResult

#: Each broker's system destinations: (prefix of the destination, what it is). Matched
#: against the destination the publisher addresses (after any prefix it adds).
SYSTEM_DESTINATIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "nats": (
        ("$", "a NATS system subject ($JS. JetStream API, $SYS. server events, $KV., $O.)"),
        ("_INBOX.", "a NATS reply subject (another client's request inbox)"),
    ),
    "kafka": (
        ("__", "a Kafka internal topic (__consumer_offsets, __transaction_state, ...)"),
        ("_schemas", "the Schema Registry's storage topic"),
        ("_confluent", "a Confluent Platform internal topic"),
    ),
    "rabbitmq": (
        (
            "amq.",
            "a name RabbitMQ reserves (server-named amq.gen-* queues, the"
            " amq.rabbitmq.reply-to pseudo-queue, amq.* exchanges)",
        ),
    ),
    "redis": (("outboxkit:dedup:", "the Redis publisher's own dedup keys"),),
}

#: The URL option that allows system destinations (``publishers.from_url`` reads it).
ALLOW_SYSTEM_OPTION = "allow_system"
_MAX_STORED_HEADERS = MAX_HEADERS + ADDED_HEADERS
# The guard's memory of what passed: at most this many shapes and header names, each
# topic or name at most this long (rows written by SQL may carry 64 KiB ones).
_KNOWN_MAX = 4096
_KNOWN_TEXT_MAX = 256


class Guard:
    """One publisher's publish-time refusals; ``allow_system`` globs let system names through.

    Whether a row was written through ``Event()`` cannot be known safely (plain SQL can
    write any marker), so every message is judged. What repeats is judged once: a message
    whose topic, destination, type, aggregate type and schema version passed before, and
    whose header names did, has only its own key, aggregate id and header values checked
    (the same bounds as ``event_problem``'s); anything else takes the full check.
    """

    __slots__ = ("_allow_system", "_names", "_prefixes", "_shapes", "_starts", "broker")

    def __init__(self, broker: str, allow_system: Iterable[str] = ()) -> None:
        self.broker = broker
        self._prefixes = SYSTEM_DESTINATIONS.get(broker, ())
        # One C-level startswith over every prefix: the relay asks it of every event.
        self._starts = tuple(prefix for prefix, _what in self._prefixes)
        self._shapes: set[tuple[str, str | None, str, str | None, str | None]] = set()
        self._names: set[str] = set()
        self._allow_system: tuple[str, ...] = tuple(allow_system)

    @property
    def allow_system(self) -> tuple[str, ...]:
        return self._allow_system

    @allow_system.setter
    def allow_system(self, globs: Iterable[str]) -> None:
        self._allow_system = tuple(globs)
        self._shapes.clear()  # verdicts on topics depend on it

    def allowed(self, destination: str) -> bool:
        """True if the deployment allowed ``destination`` (a system one) explicitly."""
        return any(fnmatch.fnmatchcase(destination, g) for g in self._allow_system)

    def refuse(
        self, message: OutboundMessage, destination: str | None = None
    ) -> PublishResult | None:
        """The permanent verdict on a message that must not be sent, or None to send it.

        ``destination`` is what the publisher addresses when it differs from the topic
        (a prefix added); the system names are checked on it.
        """
        shape = (
            message.topic,
            destination,
            message.event_type,
            message.aggregate_type,
            message.schema_version,
        )
        if shape in self._shapes:
            # The fields that vary per event, against event_problem's own fast-path bounds.
            key, subject, headers = message.key, message.aggregate_id, message.headers
            if (
                (key is None or (len(key) * 4 <= MAX_KEY_BYTES and key.isprintable()))
                and (
                    subject is None
                    or (len(subject) * 4 <= MAX_AGGREGATE_ID_BYTES and subject.isprintable())
                )
                and (not headers or self._known_headers(headers))
            ):
                return None
        verdict = self._judge(message, destination)
        if verdict is None:
            if len(self._shapes) >= _KNOWN_MAX or len(self._names) >= _KNOWN_MAX:
                self._shapes.clear()
                self._names.clear()
            if len(message.topic) <= _KNOWN_TEXT_MAX:  # a row's oversized topic: not kept
                self._shapes.add(shape)
            self._names.update(n for n in message.headers if len(n) <= _KNOWN_TEXT_MAX)
        return verdict

    def _known_headers(self, headers: dict[str, str]) -> bool:
        """True if every name passed before and every value is short and printable."""
        if len(headers) > _MAX_STORED_HEADERS:
            return False
        names = self._names
        for name, value in headers.items():
            if name not in names or len(value) * 4 > MAX_HEADER_VALUE_BYTES:
                return False
            if not value.isprintable():
                return False
        return True

    def _judge(self, message: OutboundMessage, destination: str | None) -> PublishResult | None:
        """The full check: ``Event()``'s rules, then the broker's system destinations."""
        problem = event_problem(
            message.topic,
            message.event_type,
            message.key,
            message.aggregate_type,
            message.aggregate_id,
            message.headers,
            message.schema_version,
            MAX_KEY_BYTES,
            _MAX_STORED_HEADERS,
            bool(self._allow_system) and self.allowed(message.topic),
        )
        if problem is not None:
            return PublishResult.permanent(
                f"{self.broker}: {problem}; not published (the rules of Event(), outboxkit.limits)",
                "invalid_event",
            )
        problem = self.destination_problem(message.topic if destination is None else destination)
        if problem is not None:
            return PublishResult.permanent(f"{self.broker}: {problem}", "system_destination")
        return None

    def destination_problem(self, destination: str) -> str | None:
        """Why ``destination`` is a system one this deployment did not allow, or None."""
        if not destination.startswith(self._starts):  # the common case: no system prefix
            return None
        for prefix, what in self._prefixes:
            if destination.startswith(prefix) and not self.allowed(destination):
                return (
                    f"destination {destination[:80]!r} is {what}; not published (allow it with"
                    f" the publisher's {ALLOW_SYSTEM_OPTION}=GLOB option if it is meant)"
                )
        return None


def allow_system_destinations(publisher: object, globs: Iterable[str]) -> None:
    """Let ``publisher`` send to the system destinations matching ``globs`` (fnmatch)."""
    guard = getattr(publisher, "guard", None)
    if not isinstance(guard, Guard):
        raise ConfigurationError(
            f"{type(publisher).__name__} has no system destinations to allow"
            f" ({ALLOW_SYSTEM_OPTION}= applies to the kafka, nats, amqp, redis, sqs and http"
            " publishers)"
        )
    guard.allow_system = tuple(globs)


def split_allow_system(url: str) -> tuple[str, tuple[str, ...]]:
    """``url`` without its ``allow_system=`` options, and their globs (comma-separated).

    The rest of the URL is kept byte for byte (a webhook URL's query is its template).
    """
    base, question, rest = url.partition("?")
    if not question:
        return url, ()
    query, hash_, fragment = rest.partition("#")
    kept: list[str] = []
    globs: list[str] = []
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if unquote_plus(name) == ALLOW_SYSTEM_OPTION:
            these = [g.strip() for g in unquote_plus(value).split(",") if g.strip()]
            globs += these
            if not these:
                raise ConfigurationError(
                    f"{ALLOW_SYSTEM_OPTION}= needs at least one destination glob,"
                    f" e.g. {ALLOW_SYSTEM_OPTION}=$KV.orders.*"
                )
        else:
            kept.append(part)
    if len(kept) == len(query.split("&")):
        return url, ()
    new_query = "&".join(kept)
    return base + ("?" + new_query if new_query else "") + hash_ + fragment, tuple(globs)
