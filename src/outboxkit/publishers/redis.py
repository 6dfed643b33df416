"""Redis Streams publisher: one ``XADD`` per event, the whole batch in one pipelined round trip.

Redis confirms a write by replying to it; there is no stronger acknowledgement.
How durable a reply is depends on the server: with ``appendonly yes`` and
``appendfsync always`` the write is on disk before the reply, with the
defaults it can be lost in a crash. ``wait_replicas=N`` adds ``WAIT N`` to the
pipeline, so a batch counts as published only once N replicas have it.

With ``dedup_window=SECONDS`` each event is added by a Lua script that first
claims ``outboxkit:dedup:<topic>:<event_id>`` with ``SET NX EX``: a batch
re-published after a relay crash adds nothing the stream already has.

A topic is a key name: ``stream_prefix=`` keeps every stream in a namespace and
``allow=`` lists the topics that may be published (see ``Destinations``); without
either an event could append to, or trim, any stream of the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from outboxkit._redact import redact
from outboxkit._text import describe
from outboxkit.errors import ConfigurationError
from outboxkit.publishers._util import too_large
from outboxkit.publishers.base import OutboundMessage, PublishResult, Reachability
from outboxkit.publishers.reserved import Guard
from outboxkit.publishers.routing import Destinations
from outboxkit.wire import redis as wire

log = logging.getLogger("outboxkit.redis")

DEDUP_KEY_PREFIX = "outboxkit:dedup:"
# Redis's defaults for the largest argument (proto-max-bulk-len) and the largest command
# (client-query-buffer-limit), used when CONFIG GET is not allowed (managed services).
# Over either the server answers with a protocol error and closes the connection, which
# fails the whole pipeline: every other event of the batch.
_DEFAULT_MAX_BULK = 512 * 1024 * 1024
_DEFAULT_MAX_QUERY = 1024 * 1024 * 1024
# The text fields besides data and headers together, at most: ~12 of 64 KiB, UTF-8.
_TEXT_FIELDS_BOUND = 12 * 4 * 64 * 1024
_DEFAULT_TIMEOUT = 10.0
_CONNECT_TIMEOUT = 5.0

# KEYS[1] dedup key, KEYS[2] stream; ARGV[1] window (s), ARGV[2] MAXLEN (0: none), ARGV[3..] fields.
# A script runs atomically. If XADD fails (e.g. the key holds another type) the dedup
# key is removed again, or the retry would skip the event forever.
_DEDUP_XADD = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
local reply
if tonumber(ARGV[2]) > 0 then
  reply = redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 3))
else
  reply = redis.pcall('XADD', KEYS[2], '*', unpack(ARGV, 3))
end
if type(reply) == 'table' and reply.err then
  redis.call('DEL', KEYS[1])
  return reply
end
return 1
"""

# redis-py options that may ride in the URL query (TLS files, client name, ...).
_CLIENT_OPTIONS_PREFIXES = ("ssl_",)
_CLIENT_OPTIONS = {"client_name", "protocol"}


class RedisStreamsPublisher:
    """Appends events to the stream named by the topic, fields per the outboxkit wire format.

    Fields: ``data`` (payload bytes), ``ce_<attr>`` for every CloudEvents
    attribute, ``headers`` (JSON object of the user headers, absent when empty).
    """

    name = "redis"
    #: What a topic's key must hold, for the error when it holds another type.
    _key_kind = "a stream"
    #: Logged at start when any topic may name any key (the Celery publisher has its own).
    _unrestricted_warning = (
        "redis publisher without stream_prefix= or allow=: an event's topic can name"
        " any key of the database, so an event could append to (or, with maxlen,"
        " trim) another application's stream; set stream_prefix=NAMESPACE: or"
        " allow=GLOB,... in the broker URL (docs/brokers.md#redis-streams)"
    )
    #: Whole batches confirmed in one round trip: large batches, four in flight.
    batch_shape = (1000, 4)

    def __init__(
        self,
        url: str,
        *,
        maxlen: int | None = None,
        dedup_window: int = 0,
        timeout: float = _DEFAULT_TIMEOUT,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
        stream_prefix: str = "",
        allow: Sequence[str] = (),
    ) -> None:
        if maxlen is not None and maxlen < 1:
            raise ConfigurationError("redis maxlen must be at least 1 (or left out: no trimming)")
        if dedup_window < 0:
            raise ConfigurationError("redis dedup_window must be >= 0 seconds (0: off)")
        if timeout <= 0 or wait_timeout <= 0:
            raise ConfigurationError("redis timeout and wait_timeout must be positive (seconds)")
        if wait_replicas < 0:
            raise ConfigurationError("redis wait_replicas must be >= 0")
        self._url = url
        self._maxlen = maxlen
        self._dedup_window = dedup_window
        self._timeout = timeout
        self._wait_replicas = wait_replicas
        self._wait_ms = max(1, round(wait_timeout * 1000))
        self._client: Any = None
        self._script_sha: str | None = None
        self._max_bulk = _DEFAULT_MAX_BULK
        self._max_query = _DEFAULT_MAX_QUERY
        self.destinations = Destinations(stream_prefix, tuple(allow))
        #: For the relay's /readyz: unreachable once round trips have failed to connect for a
        #: few seconds with none answered (redis-py reports no connection events).
        self.reachability = Reachability()
        #: Event()'s rules and the broker's system destinations, at publish (reserved.py).
        self.guard = Guard(self.name)

    @classmethod
    def from_url(cls, url: str) -> RedisStreamsPublisher:
        """``redis[s]://[:password@]host:6379/0?stream_prefix=outbox:&maxlen=N&dedup_window=S``.

        Also ``allow=GLOB,GLOB`` (topics that may be published), ``timeout``,
        ``wait_replicas=N&wait_timeout=SECONDS`` (``WAIT`` after each batch) and
        redis-py's ``ssl_*`` and ``client_name`` options.
        """
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("redis", "rediss"):
            raise ConfigurationError(f"not a redis:// or rediss:// URL: {redact(url)}")
        if not parts.hostname:
            raise ConfigurationError(
                f"redis URL needs a host: {redact(url)} (e.g. redis://127.0.0.1:6379/0)"
            )
        try:
            _ = parts.port
        except ValueError:
            raise ConfigurationError(f"redis URL has an invalid port: {redact(url)}") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ConfigurationError(
                f"redis URL path must be a database number such as /0, not /{db}"
            )
        options: dict[str, Any] = {}
        passthrough: list[tuple[str, str]] = []
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key in ("maxlen", "dedup_window", "wait_replicas"):
                options[key] = _number(key, value, int)
            elif key in ("timeout", "wait_timeout"):
                options[key] = _number(key, value, float)
            elif key == "stream_prefix":
                options[key] = value
            elif key == "allow":
                options[key] = Destinations.parse_allow(value)
            elif key in _CLIENT_OPTIONS or key.startswith(_CLIENT_OPTIONS_PREFIXES):
                passthrough.append((key, value))
            else:
                raise ConfigurationError(
                    f"unknown redis URL option {key!r}: use stream_prefix, allow, maxlen,"
                    " dedup_window, timeout, wait_replicas, wait_timeout, client_name or ssl_*"
                )
        client_url = urlunsplit(parts._replace(query=urlencode(passthrough), fragment=""))
        return cls(client_url, **options)

    def __repr__(self) -> str:
        return f"RedisStreamsPublisher(url={redact(self._url)!r})"

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        """Check the server answers; if it is down, the first batch tries again."""
        if not self.destinations.restricted:
            log.warning(self._unrestricted_warning)
        client = self._ensure_client()
        try:
            await client.ping()
            await self._read_limits(client)
            if self._dedup_window:
                self._script_sha = await client.script_load(_DEDUP_XADD)
        except Exception as exc:
            log.warning("Redis not reachable at start (%s); will retry", describe(exc))

    async def _read_limits(self, client: Any) -> None:
        """The server's proto-max-bulk-len and client-query-buffer-limit, if it tells them."""
        for name, attribute in (
            ("proto-max-bulk-len", "_max_bulk"),
            ("client-query-buffer-limit", "_max_query"),
        ):
            try:
                reply = await client.config_get(name)
            except redis.exceptions.ResponseError:  # CONFIG refused (ACL, a managed service)
                continue
            value = (reply or {}).get(name)
            if value is not None and str(value).isdigit():
                setattr(self, attribute, int(value))

    def _too_large(self, fields: dict[str, bytes | str], stream: str) -> PublishResult | None:
        """The dead letter of an entry the server would refuse for its size, or None.

        Only ``data`` (the payload) and ``headers`` can be large: the other fields are
        text the store bounds (64 KiB each), far under the smallest proto-max-bulk-len.
        """
        payload = len(fields["data"])
        headers = len(fields.get("headers", b""))
        largest = max(payload, headers)
        if largest > self._max_bulk:
            return too_large(
                "redis",
                largest,
                "in its largest field (the payload or the headers)",
                "the server's proto-max-bulk-len",
                self._max_bulk,
                "raise proto-max-bulk-len in redis.conf, or send less",
            )
        if payload + headers + _TEXT_FIELDS_BOUND > self._max_query:
            total = len(stream.encode()) + sum(
                len(name) + len(value if isinstance(value, bytes) else value.encode())
                for name, value in fields.items()
            )
            if total > self._max_query:
                return too_large(
                    "redis",
                    total,
                    "with all its fields",
                    "the server's client-query-buffer-limit",
                    self._max_query,
                    "raise client-query-buffer-limit in redis.conf, or send less",
                )
        return None

    def _ensure_client(self) -> Any:
        if self._client is None:
            # No client-side retries: re-sending a pipeline after a lost reply only
            # doubles what the relay's own retry does, and hides outages for longer.
            self._client = redis.asyncio.Redis.from_url(
                self._url,
                socket_timeout=self._timeout,
                socket_connect_timeout=min(_CONNECT_TIMEOUT, self._timeout),
                retry=Retry(NoBackoff(), 0),
                health_check_interval=30,
            )
        return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.aclose(), 5.0)

    # -- publishing ---------------------------------------------------------------

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        client = self._ensure_client()
        results: list[PublishResult | None] = [None] * len(messages)
        streams: list[str] = [""] * len(messages)
        encoded: list[dict[str, bytes | str]] = [{}] * len(messages)
        todo: list[int] = []
        for i, message in enumerate(messages):
            stream, refused = self.destinations.resolve(message.topic)
            if stream is None:
                results[i] = PublishResult.permanent(f"redis: {refused}", "not_allowed")
                continue
            if (refusal := self.guard.refuse(message, stream)) is not None:
                results[i] = refusal
                continue
            fields = self._encode(message, stream)
            too_big = self._too_large(fields, stream)
            if too_big is not None:
                results[i] = too_big
                continue
            streams[i], encoded[i] = stream, fields
            todo.append(i)
        for _ in range(2):  # a second pass only if the server lost our script (restart)
            if not todo:
                break
            replies = await self._send(
                client, [(messages[i], streams[i], encoded[i]) for i in todo]
            )
            if isinstance(replies, PublishResult):
                return [r if r is not None else replies for r in results]
            again: list[int] = []
            for i, reply in zip(todo, replies, strict=True):
                if isinstance(reply, redis.exceptions.NoScriptError):
                    again.append(i)
                else:
                    results[i] = _result(reply, streams[i], self._key_kind)
            if not again:
                break
            self._script_sha = None
            todo = again
        missing = PublishResult.retry("redis: the dedup script was not loaded", "no_script")
        return [r if r is not None else missing for r in results]

    async def _send(
        self, client: Any, messages: Sequence[tuple[OutboundMessage, str, dict[str, bytes | str]]]
    ) -> list[Any] | PublishResult:
        """One pipelined round trip; per-command errors come back in place of replies.

        Returns the verdict for every message instead when the whole round trip failed:
        handed back untried when the server was not reached (an outage burns no attempts).
        """
        try:
            if self._dedup_window and self._script_sha is None:
                self._script_sha = await client.script_load(_DEDUP_XADD)
            async with client.pipeline(transaction=False) as pipe:
                for message, stream, fields in messages:
                    self._queue(pipe, message, stream, fields)
                if self._wait_replicas:
                    pipe.execute_command("WAIT", self._wait_replicas, self._wait_ms)
                replies: list[Any] = await pipe.execute(raise_on_error=False)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            self.reachability.failed(type(exc).__name__)
            text = f"redis: server unreachable or not answering: {describe(exc)}"
            return PublishResult.hand_back(text, "unreachable")
        except redis.exceptions.RedisError as exc:
            self.reachability.succeeded()  # the server answered, with an error
            return PublishResult.retry(f"redis: {describe(exc)}", "connection")
        self.reachability.succeeded()
        if self._wait_replicas:
            acked = replies.pop()
            if isinstance(acked, int) and acked < self._wait_replicas:
                error = PublishResult.retry(
                    f"redis: written to the primary, but only {acked} of {self._wait_replicas}"
                    f" replica(s) acknowledged within {self._wait_ms} ms (WAIT)",
                    "replicas",
                )
                return [r if isinstance(r, Exception) else error for r in replies]
        return replies

    def _encode(self, message: OutboundMessage, stream: str) -> dict[str, bytes | str]:
        """The entry's fields (the Celery publisher's one ``data`` field is kombu's envelope)."""
        return wire.encode(message)

    def _queue(
        self, pipe: Any, message: OutboundMessage, stream: str, fields: dict[str, bytes | str]
    ) -> None:
        if self._dedup_window:
            args: list[Any] = [self._dedup_window, self._maxlen or 0]
            for name, value in fields.items():
                args += [name, value]
            pipe.evalsha(
                self._script_sha,
                2,
                f"{DEDUP_KEY_PREFIX}{stream}:{message.event_id}",
                stream,
                *args,
            )
        elif self._maxlen:
            pipe.xadd(stream, fields, maxlen=self._maxlen, approximate=True)
        else:
            pipe.xadd(stream, fields)


def _result(reply: Any, stream: str, kind: str) -> PublishResult:
    if isinstance(reply, PublishResult):
        return reply
    if not isinstance(reply, Exception):
        return PublishResult.success()  # a stream entry id, or 0/1 from the dedup script
    text = describe(reply)
    if "WRONGTYPE" in str(reply):
        # The key holds another type (than a stream, or a Celery queue's list): no retry helps.
        return PublishResult.permanent(
            f"redis: key {stream!r} exists and is not {kind} ({text});"
            " rename the key or route the topic elsewhere, then `outboxkit replay`",
            "wrong_type",
        )
    return PublishResult.retry(f"redis: {text}", type(reply).__name__)


def _number(key: str, value: str, kind: type[int] | type[float]) -> Any:
    try:
        return kind(value)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise ConfigurationError(f"redis URL option {key}={value!r} is not {noun}") from None
