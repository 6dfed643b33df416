"""The event envelope: validation at construction, UUIDv7 ids, CloudEvents names."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from uuid_utils.compat import uuid7

from outboxkit.errors import InvalidEventError
from outboxkit.limits import (
    DEFAULT_MAX_KEY_BYTES,
    MAX_KEY_BYTES,
    MAX_SCHEMA_VERSION_CHARS,
    event_problem,
)
from outboxkit.tracing import capture as _capture_trace_context

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024


def new_event_id() -> uuid.UUID:
    """A UUIDv7: time-ordered, so ids sort by creation and index well."""
    return uuid7()


class Event:
    """One event to publish: destination, domain metadata and an opaque payload.

    The payload is encoded once, here: a ``bytes`` payload is kept as is, any
    other value is encoded as JSON with orjson (:func:`encode_payload`: datetimes,
    UUIDs, dataclasses and enums as orjson writes them, ``Decimal`` as a string, pydantic
    models through ``model_dump(mode="json")``). A value none of those cover waits for
    the ``default=`` hook of the ``Outbox`` that writes the event; without one, that
    write (or reading ``payload``) raises, naming the value's path. Every check happens at
    construction, so a bad event fails in the caller's code before anything
    reaches the database. Every field is bounded and free of control characters,
    and header names a broker acts on are refused (``outboxkit.limits`` says what
    and why): a topic or a header can never inject a broker command or forge an id.
    A topic naming a broker's system destination (``$JS.API...``, ``_INBOX.``) is refused
    too, unless ``allow_system_topic=True`` (the relay's publisher must allow it as well).

    ``occurred_at`` is when the fact happened (a timezone-aware datetime; default:
    now, at construction) and is what every broker sends as the event's time —
    not the row's ``created_at``, which only says when the outbox got it.
    ``schema_version`` labels the payload's shape (a string of up to 64
    printable characters, or a non-negative int, carried as its decimal string)
    so consumers can tell versions apart without parsing the payload.

    ``deliver_at`` (a timezone-aware datetime) or ``delay`` (a non-negative
    timedelta, counted from construction on the application's clock, as
    ``occurred_at``) schedules the event: the relay publishes it no earlier than that
    time, read on the database server's clock, and within its ``poll_interval`` after
    it (no NOTIFY wakes a relay for a future event). It is stored as the row's
    ``available_at`` (None here: publish at once). Under an ordered relay a scheduled
    event also holds back the later events of its key: order wins.
    """

    __slots__ = (
        "_payload",
        "_unencoded",
        "aggregate_id",
        "aggregate_type",
        "available_at",
        "event_id",
        "event_type",
        "headers",
        "key",
        "occurred_at",
        "schema_version",
        "topic",
    )

    event_id: uuid.UUID
    topic: str
    event_type: str
    _payload: bytes | None
    _unencoded: Any
    key: str | None
    aggregate_type: str | None
    aggregate_id: str | None
    headers: dict[str, str]
    occurred_at: dt.datetime
    schema_version: str | None
    available_at: dt.datetime | None

    def __init__(
        self,
        *,
        topic: str,
        event_type: str,
        payload: Any,
        key: str | None = None,
        aggregate_type: str | None = None,
        aggregate_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        event_id: uuid.UUID | None = None,
        occurred_at: dt.datetime | None = None,
        schema_version: str | int | None = None,
        deliver_at: dt.datetime | None = None,
        delay: dt.timedelta | None = None,
        allow_system_topic: bool = False,
    ) -> None:
        if not isinstance(topic, str) or not topic.strip():
            raise InvalidEventError("event topic must be a non-empty string")
        if not isinstance(event_type, str) or not event_type.strip():
            raise InvalidEventError(f"event_type must be a non-empty string (topic {topic!r})")
        for name, value in (
            ("key", key),
            ("aggregate_type", aggregate_type),
            ("aggregate_id", aggregate_id),
        ):
            if value is not None and not isinstance(value, str):
                raise InvalidEventError(
                    f"{name} must be a string or None, got {type(value).__name__}"
                    " (convert ids with str())"
                )
        clean_headers: dict[str, str] = {}
        if headers is not None:
            if not isinstance(headers, Mapping):
                raise InvalidEventError("headers must be a mapping of str to str")
            for hname, hvalue in headers.items():
                if not isinstance(hname, str) or not hname:
                    raise InvalidEventError(f"header names must be non-empty strings: {hname!r}")
                if not isinstance(hvalue, str):
                    raise InvalidEventError(
                        f"header {hname!r} must be a string, got {type(hvalue).__name__}"
                    )
                clean_headers[hname] = hvalue
        # The rules every publisher applies again to what the relay claims (outboxkit.limits).
        problem = event_problem(
            topic=topic,
            event_type=event_type,
            key=key,
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            headers=clean_headers,
            allow_system_topic=allow_system_topic,
        )
        if problem is not None:
            raise InvalidEventError(f"event {problem} (see outboxkit.limits)")
        self._unencoded = None
        if isinstance(payload, bytes | bytearray | memoryview):
            self._payload = bytes(payload)
            is_json = False
        else:
            try:
                self._payload = orjson.dumps(payload, default=_builtin_default)
            except TypeError as exc:
                if not str(exc).startswith(_UNKNOWN_TYPE):  # a bad string, key or number
                    raise InvalidEventError(
                        f"payload of {event_type!r} is not JSON-serialisable:"
                        f" {_unencodable(payload, _builtin_default) or exc}"
                    ) from None
                # A type the Outbox's default= hook may know: encoded (or refused) at its put.
                self._payload, self._unencoded = None, payload
            is_json = True
        # W3C traceparent/tracestate of the active span, if any (a dict lookup otherwise).
        _capture_trace_context(clean_headers)
        if not is_json and "content-type" not in clean_headers:
            # JSON is the default content type and costs no bytes; say so only for raw bytes.
            clean_headers["content-type"] = "application/octet-stream"
        self.occurred_at = _occurred_at(occurred_at)
        self.schema_version = _schema_version(schema_version)
        self.available_at = _available_at(deliver_at, delay)
        self.event_id = event_id if event_id is not None else new_event_id()
        self.topic = topic
        self.event_type = event_type
        self.key = key
        self.aggregate_type = aggregate_type
        self.aggregate_id = aggregate_id
        self.headers = clean_headers

    @property
    def payload(self) -> bytes:
        """The encoded payload; raises if a value in it is still unencodable."""
        if self._payload is None:
            self.encode_payload(None)
        assert self._payload is not None
        return self._payload

    @property
    def payload_pending(self) -> bool:
        """Whether the payload waits for a ``default=`` hook (Outbox(default=...))."""
        return self._payload is None

    def encode_payload(self, default: Callable[[Any], Any] | None) -> None:
        """Encode a pending payload with ``default`` for the values the built-ins lack.

        Raises :class:`InvalidEventError` naming the first value neither handles by its
        path in the payload (``payload.items[2].price: Decimal ...``).
        """
        if self._payload is not None:
            return
        hook = _with_default(default)
        try:
            self._payload = orjson.dumps(self._unencoded, default=hook)
        except TypeError as exc:
            raise InvalidEventError(
                f"payload of {self.event_type!r} is not JSON-serialisable:"
                f" {_unencodable(self._unencoded, hook) or exc}; give the Outbox a"
                " default= hook that turns it into JSON types, or pass bytes to publish a"
                " payload you encoded yourself"
            ) from None
        self._unencoded = None

    def check_size(
        self, max_payload_bytes: int, max_key_bytes: int = DEFAULT_MAX_KEY_BYTES
    ) -> None:
        """Refuse payloads and keys the outbox was configured not to carry."""
        if len(self.payload) > max_payload_bytes:
            raise InvalidEventError(
                f"payload of {self.event_type!r} is {len(self.payload)} bytes,"
                f" over max_payload_bytes={max_payload_bytes}"
            )
        if self.key is not None and len(self.key) * 4 > max_key_bytes:  # cheap when short
            size = len(self.key.encode("utf-8", "surrogatepass"))
            if size > max_key_bytes:
                raise InvalidEventError(
                    f"key of {self.event_type!r} is {size} bytes, over max_key_bytes="
                    f"{max_key_bytes}; keys are ids (Outbox(max_key_bytes=...) raises the"
                    f" limit up to {MAX_KEY_BYTES})"
                )

    def __repr__(self) -> str:
        version = f" schema_version={self.schema_version!r}," if self.schema_version else ""
        if self.available_at is not None:
            version += f" deliver_at={self.available_at.isoformat()},"
        return (
            f"Event(event_id={self.event_id!s}, topic={self.topic!r},"
            f" event_type={self.event_type!r}, key={self.key!r},{version}"
            f" payload=<{len(self.payload)} bytes>)"
        )


# How orjson says that neither it nor the default hook knows a value's type.
_UNKNOWN_TYPE = "Type is not JSON serializable"


def _builtin_default(value: Any) -> Any:
    """What orjson cannot write itself: ``Decimal`` (as a string: money keeps its digits)
    and pydantic models (``model_dump(mode="json")``)."""
    if isinstance(value, decimal.Decimal):
        return str(value)
    dump = getattr(value, "model_dump", None)
    if dump is not None and any(c.__module__.startswith("pydantic") for c in type(value).__mro__):
        return dump(mode="json")
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def _with_default(default: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """The built-in hook, then the user's ``default`` for what it does not know."""
    if default is None:
        return _builtin_default

    def hook(value: Any) -> Any:
        try:
            return _builtin_default(value)
        except TypeError:
            return default(value)

    return hook


def encode_payload(payload: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """A payload as the outbox stores it: orjson with the built-in hook and ``default``."""
    return orjson.dumps(payload, default=_with_default(default))


def _unencodable(value: Any, hook: Callable[[Any], Any], path: str = "payload") -> str | None:
    """The path and type of the first value in ``value`` that does not encode, or None.

    Walks what orjson walks (dicts, lists, tuples, dataclasses) and what the hook turns
    into those, so the message names ``payload.items[2].price``, not just a type.
    """
    try:
        orjson.dumps(value, default=hook)
        return None
    except TypeError as exc:
        reason = str(exc)
    children: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        children = [
            (f"{path}.{k}" if isinstance(k, str) else f"{path}[{k!r}]", v) for k, v in value.items()
        ]
    elif isinstance(value, list | tuple):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [(f"{path}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:
        try:
            converted = hook(value)
        except Exception:
            return f"{path}: {type(value).__name__} {_short(value)} ({reason})"
        if converted is value or type(converted) is type(value):
            return f"{path}: {type(value).__name__} {_short(value)} ({reason})"
        return _unencodable(converted, hook, path) or f"{path}: {type(value).__name__} ({reason})"
    if isinstance(value, dict) and any(not isinstance(k, str) for k in value):
        bad = next(k for k in value if not isinstance(k, str))
        return f"{path}: key {bad!r} is a {type(bad).__name__}, not a string"
    for child_path, child in children:
        if (found := _unencodable(child, hook, child_path)) is not None:
            return found
    return f"{path}: {reason}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _occurred_at(value: dt.datetime | None) -> dt.datetime:
    """When the fact happened: the application's aware datetime, or now."""
    if value is None:
        return dt.datetime.now(dt.UTC)
    if not isinstance(value, dt.datetime):
        raise InvalidEventError(f"occurred_at must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidEventError(
            "occurred_at must be timezone-aware (a naive datetime is ambiguous);"
            " e.g. datetime.now(timezone.utc) or dt.replace(tzinfo=timezone.utc)"
        )
    return value


def _available_at(deliver_at: dt.datetime | None, delay: dt.timedelta | None) -> dt.datetime | None:
    """When the relay may publish: ``deliver_at``, now + ``delay``, or None (at once)."""
    if delay is not None:
        if deliver_at is not None:
            raise InvalidEventError(
                "give deliver_at or delay, not both (delay=d is deliver_at=now + d)"
            )
        if not isinstance(delay, dt.timedelta):
            raise InvalidEventError(
                f"delay must be a datetime.timedelta, got {type(delay).__name__}"
            )
        if delay < dt.timedelta(0):
            raise InvalidEventError(f"delay must not be negative, got {delay}")
        if not delay:
            return None
        try:
            return dt.datetime.now(dt.UTC) + delay
        except OverflowError:
            raise InvalidEventError(f"delay {delay} runs past the year 9999") from None
    if deliver_at is None:
        return None
    if not isinstance(deliver_at, dt.datetime):
        raise InvalidEventError(
            f"deliver_at must be a datetime, got {type(deliver_at).__name__}"
            " (for a duration use delay=timedelta(...))"
        )
    if deliver_at.tzinfo is None or deliver_at.utcoffset() is None:
        raise InvalidEventError(
            "deliver_at must be timezone-aware (a naive datetime is ambiguous);"
            " e.g. datetime.now(timezone.utc) + timedelta(minutes=5)"
        )
    return deliver_at


def _schema_version(value: str | int | None) -> str | None:
    """The payload's schema version as the string every broker carries, or None."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidEventError(f"schema_version must not be negative, got {value}")
        return str(value)
    if not isinstance(value, str):
        raise InvalidEventError(
            f"schema_version must be a string or an int, got {type(value).__name__}"
        )
    if not value or len(value) > MAX_SCHEMA_VERSION_CHARS or not value.isprintable():
        raise InvalidEventError(
            f"schema_version must be 1 to {MAX_SCHEMA_VERSION_CHARS} printable characters,"
            f" got {value!r} (a version label such as 3 or '2.1', not the schema itself)"
        )
    return value
