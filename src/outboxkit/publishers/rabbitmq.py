"""RabbitMQ publisher: aio-pika with publisher confirms, persistent messages, ``mandatory``.

A message counts as published only when the broker acks it. RabbitMQ acks a
persistent message once every queue it was routed to has it (on disk for
durable classic queues, on a quorum of nodes for quorum queues). A message no
queue is bound for is *returned* (``mandatory=True``), and a nack means the
broker could not take it: both are retried, never reported as success, so a
missing binding delays events instead of dropping them.

On the default exchange (``exchange=``) the routing key is a queue name: there
``routing_key_prefix=`` (a namespace) or ``allow=`` (topic globs) keeps events
from filling queues of other applications (see ``Destinations``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import aio_pika
import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from outboxkit._redact import redact
from outboxkit._text import describe
from outboxkit.errors import ConfigurationError
from outboxkit.publishers._util import ThrottledLog, too_large
from outboxkit.publishers.base import OutboundMessage, PublishResult, Reachability
from outboxkit.publishers.reserved import Guard
from outboxkit.publishers.routing import Destinations
from outboxkit.wire.rabbitmq import encode_headers

log = logging.getLogger("outboxkit.rabbitmq")

DEFAULT_EXCHANGE = "outboxkit"
_EXCHANGE_TYPES = ("topic", "direct", "fanout", "headers")
_DEFAULT_TIMEOUT = 10.0
_CONNECT_TIMEOUT = 5.0
# RabbitMQ's max_message_size (the body's bytes) by default: 128 MiB up to 3.13, 16 MiB
# from 4.0 (read from the server's version). Checked before sending because the broker
# answers an oversized message by closing the channel, which fails every other publish
# in flight on it; a content header over frame_max closes the whole connection.
_MAX_MESSAGE_BYTES_3 = 128 * 1024 * 1024
_MAX_MESSAGE_BYTES_4 = 16 * 1024 * 1024
# The properties frame's fixed part (frame header and end, class, weight, body size, flags)
# and what a property other than headers takes at most: judged exactly only above this.
_HEADER_FRAME_BOUND = 1024
# A content header frame without its properties: type, channel and size (7), class,
# weight and body size (12), frame end (1).
_CONTENT_HEADER_FRAME = 20
_MAX_ROUTING_KEY_BYTES = 255
# Header (field table) names: pamqp silently truncates longer ones to 128 bytes, which
# would alter the event (and could merge two headers into one).
_MAX_FIELD_NAME_BYTES = 128
# Query options aiormq itself understands (TLS files, heartbeat, ...): passed through.
_CLIENT_OPTIONS = {
    "heartbeat",
    "name",
    "auth",
    "cafile",
    "capath",
    "cadata",
    "keyfile",
    "certfile",
    "no_verify_ssl",
}
# After the connection is lost, the publisher connects again this often (seconds).
_RECONNECT_EVERY = 1.0
_OVERSIZED = re.compile(r"message size (\d+) is larger than configured max size")


class RabbitMQPublisher:
    """Publishes events to one exchange, routing key = topic, with confirms.

    The exchange is declared durable at start (``declare=false`` when the
    relay's user may not declare it and an operator owns it). ``exchange=``
    (empty) publishes through the default exchange, straight to the queue
    named by the topic.
    """

    name = "rabbitmq"
    #: Logged at start when any topic may name any queue (the Celery publisher has its own).
    _unrestricted_warning = (
        "rabbitmq publisher on the default exchange without routing_key_prefix= or"
        " allow=: an event's topic can name any queue of the vhost, so an event"
        " could fill another application's queue; set routing_key_prefix= or"
        " allow=GLOB,... in the broker URL, or publish through an exchange"
        " (docs/brokers.md#rabbitmq)"
    )

    def __init__(
        self,
        url: str,
        *,
        exchange: str = DEFAULT_EXCHANGE,
        exchange_type: str = "topic",
        declare: bool = True,
        timeout: float = _DEFAULT_TIMEOUT,
        max_message_bytes: int | None = None,
        routing_key_prefix: str = "",
        allow: Sequence[str] = (),
    ) -> None:
        if exchange_type not in _EXCHANGE_TYPES:
            raise ConfigurationError(
                f"rabbitmq exchange_type {exchange_type!r} is not one of"
                f" {', '.join(_EXCHANGE_TYPES)}"
            )
        if timeout <= 0:
            raise ConfigurationError("rabbitmq timeout must be positive (seconds)")
        if max_message_bytes is not None and max_message_bytes < 1:
            raise ConfigurationError("rabbitmq max_message_bytes must be at least 1")
        if exchange.startswith("amq.") and declare:
            # amq.* exchanges exist already and may not be declared by clients.
            declare = False
        self._url = url
        self._exchange_name = exchange
        self._exchange_type = exchange_type
        self._declare = declare and exchange != ""
        self._timeout = timeout
        #: The body limit set in the URL (max_message_bytes=), else the server's default,
        #: lowered to what the broker reports when it refuses a message as too large.
        self._max_message_bytes = max_message_bytes
        self._server_max_message_bytes = _MAX_MESSAGE_BYTES_3
        self._frame_max = 0  # negotiated at connect; 0: unknown, not checked
        self.destinations = Destinations(routing_key_prefix, tuple(allow))
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._connect_lock = asyncio.Lock()
        self._warn = ThrottledLog(log)
        #: For the relay's /readyz: lost when the connection closes under us or a connect
        #: fails, restored by a connect (retried in the background while idle).
        self.reachability = Reachability()
        self._reconnecting: asyncio.Task[None] | None = None
        #: Event()'s rules and the broker's system destinations, at publish (reserved.py).
        self.guard = Guard(self.name)

    @classmethod
    def from_url(cls, url: str) -> RabbitMQPublisher:
        """``amqp[s]://user:pass@host:5672/vhost?exchange=NAME&exchange_type=topic&timeout=10``.

        Other options: ``declare=false`` (use an existing exchange as is),
        ``max_message_bytes=N``, ``routing_key_prefix=P`` and ``allow=GLOB,GLOB``
        (the destinations events may reach); aiormq's own (``heartbeat``, ``cafile``,
        ``certfile``, ``keyfile``, ...) are passed through.
        """
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("amqp", "amqps"):
            raise ConfigurationError(f"not an amqp:// or amqps:// URL: {redact(url)}")
        if not parts.hostname:
            raise ConfigurationError(
                f"rabbitmq URL needs a host: {redact(url)}"
                " (e.g. amqp://guest:guest@127.0.0.1:5672/?exchange=events)"
            )
        try:
            _ = parts.port
        except ValueError:
            raise ConfigurationError(f"rabbitmq URL has an invalid port: {redact(url)}") from None
        options: dict[str, Any] = {}
        passthrough: list[tuple[str, str]] = []
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key == "exchange":
                options["exchange"] = value
            elif key == "exchange_type":
                options["exchange_type"] = value.lower()
            elif key == "declare":
                options["declare"] = _parse_bool(key, value)
            elif key == "routing_key_prefix":
                options[key] = value
            elif key == "allow":
                options[key] = Destinations.parse_allow(value)
            elif key in ("timeout", "max_message_bytes"):
                try:
                    options[key] = float(value) if key == "timeout" else int(value)
                except ValueError:
                    raise ConfigurationError(
                        f"rabbitmq URL option {key}={value!r} is not a number"
                    ) from None
            elif key in _CLIENT_OPTIONS:
                passthrough.append((key, value))
            else:
                raise ConfigurationError(
                    f"unknown rabbitmq URL option {key!r}: use exchange, exchange_type, timeout,"
                    " declare, max_message_bytes, routing_key_prefix, allow, or one of aiormq's"
                    f" ({', '.join(sorted(_CLIENT_OPTIONS))})"
                )
        client_url = urlunsplit(parts._replace(query=urlencode(passthrough), fragment=""))
        return cls(client_url, **options)

    def __repr__(self) -> str:
        return f"RabbitMQPublisher(url={redact(self._url)!r}, exchange={self._exchange_name!r})"

    # -- lifecycle --------------------------------------------------------------

    async def start(self) -> None:
        """Connect and declare the exchange if the broker is up; otherwise the first batch does.

        A broker outage at start must not crash the relay: events wait in the
        table. A configuration the broker refuses (wrong credentials, an
        exchange of another type) is logged here and reported on every batch.
        """
        if self._exchange_name == "" and not self.destinations.restricted:
            log.warning(self._unrestricted_warning)
        try:
            await self._ensure_exchange()
        except Exception as exc:
            log.warning("RabbitMQ not ready at start (%s); will retry", describe(exc))
            self._reconnect_in_background()

    async def _ensure_exchange(self) -> AbstractExchange:
        async with self._connect_lock:
            if self._channel is not None and self._channel.is_closed:
                self._channel = self._exchange = None
            connection = self._connection
            if connection is None or not _is_open(connection):
                await self._drop_connection()
                try:
                    connection = await aio_pika.connect(self._url, timeout=_CONNECT_TIMEOUT)
                except Exception as exc:
                    self.reachability.lost(type(exc).__name__)
                    raise
                self._connection = connection
                self._read_limits(connection)
                self.reachability.restored()
                connection.close_callbacks.add(
                    lambda _sender, _exc, lost=connection: self._connection_closed(lost)
                )
            if self._channel is None:
                channel = await connection.channel(publisher_confirms=True, on_return_raises=False)
                self._channel = channel
                try:
                    self._exchange = await self._open_exchange(channel)
                except BaseException:
                    self._channel = None
                    with contextlib.suppress(Exception):
                        await channel.close()
                    raise
            assert self._exchange is not None
            return self._exchange

    def _read_limits(self, connection: AbstractConnection) -> None:
        """The negotiated frame_max, and the body limit the server's version implies."""
        amqp = getattr(connection.transport, "connection", None)
        tune = getattr(amqp, "connection_tune", None)
        self._frame_max = int(getattr(tune, "frame_max", 0) or 0)
        version = (getattr(amqp, "server_properties", None) or {}).get("version", b"")
        if isinstance(version, bytes):
            version = version.decode(errors="replace")
        major = str(version).partition(".")[0]
        if major.isdigit():
            default = _MAX_MESSAGE_BYTES_4 if int(major) >= 4 else _MAX_MESSAGE_BYTES_3
            self._server_max_message_bytes = min(self._server_max_message_bytes, default)

    async def _open_exchange(self, channel: AbstractChannel) -> AbstractExchange:
        if self._exchange_name == "":
            return channel.default_exchange
        if not self._declare:
            return await channel.get_exchange(self._exchange_name, ensure=True)
        try:
            return await channel.declare_exchange(
                self._exchange_name,
                self._exchange_type,
                durable=True,
                timeout=self._timeout,
            )
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise ConfigurationError(
                f"rabbitmq exchange {self._exchange_name!r} exists with other settings ({exc});"
                f" set exchange_type= to its type, use another exchange=, or declare=false"
            ) from None

    def _connection_closed(self, connection: AbstractConnection) -> None:
        if connection is not self._connection:
            return  # closed by the publisher itself (dropped, replaced or shut down)
        self.reachability.lost("connection closed")
        self._reconnect_in_background()

    def _reconnect_in_background(self) -> None:
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        """Connect again in the background, so an idle relay sees the broker come back."""
        while not _is_open(self._connection):
            await asyncio.sleep(_RECONNECT_EVERY)
            try:
                await self._ensure_exchange()
            except Exception as exc:
                log.debug("RabbitMQ reconnect failed: %s", describe(exc))
                if isinstance(exc, ConfigurationError):
                    return  # the next batch reports it

    async def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._exchange = None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 5.0)

    async def close(self) -> None:
        if self._reconnecting is not None:
            self._reconnecting.cancel()
            self._reconnecting = None
        async with self._connect_lock:
            await self._drop_connection()

    # -- publishing ---------------------------------------------------------------

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        exchange = await self._ensure_exchange()
        results = await asyncio.gather(*(self._publish_one(exchange, m) for m in messages))
        if any(r.error_class == "channel_closed" for r in results):
            # The next batch opens a fresh channel (and connection, if that went too).
            self._warn.warning("RabbitMQ channel lost mid-batch; reopening on the next batch")
        return list(results)

    async def _publish_one(
        self, exchange: AbstractExchange, message: OutboundMessage
    ) -> PublishResult:
        routing_key, refused = self.destinations.resolve(message.topic)
        if routing_key is None:
            return PublishResult.permanent(f"rabbitmq: {refused}", "not_allowed")
        if (refusal := self.guard.refuse(message, routing_key)) is not None:
            return refusal
        where = f"exchange {self._exchange_name!r} with routing key {routing_key!r}"
        if len(routing_key.encode()) > _MAX_ROUTING_KEY_BYTES:
            return PublishResult.permanent(
                f"rabbitmq: routing key (the topic) is longer than {_MAX_ROUTING_KEY_BYTES} bytes",
                "routing_key_too_long",
            )
        for name in message.headers:
            # (4 bytes per character at most: short names skip the encode)
            if len(name) * 4 > _MAX_FIELD_NAME_BYTES and len(name.encode()) > _MAX_FIELD_NAME_BYTES:
                return PublishResult.permanent(
                    f"rabbitmq: header name {name[:40]!r}… is over {_MAX_FIELD_NAME_BYTES}"
                    " bytes (the client would truncate it)",
                    "header_name_too_long",
                )
        amqp_message = self._amqp_message(message)
        too_big = self._too_large(amqp_message)
        if too_big is not None:
            return too_big
        try:
            confirmation = await exchange.publish(
                amqp_message, routing_key, mandatory=True, timeout=self._timeout
            )
        except aiormq.exceptions.DeliveryError as exc:
            # str(exc) would embed the whole message; the frame name says enough.
            frame = type(exc.frame).__name__
            return PublishResult.retry(
                f"rabbitmq: broker nacked the message ({frame}) for {where}", "nack"
            )
        except TimeoutError:
            return PublishResult.retry(
                f"rabbitmq: no publisher confirm within {self._timeout:g}s for {where}",
                "publish_timeout",
            )
        except (aiormq.exceptions.ChannelClosed, aiormq.exceptions.ChannelInvalidStateError) as exc:
            return self._channel_lost(exc, where, message)
        except (aiormq.exceptions.AMQPConnectionError, ConnectionError, OSError) as exc:
            result = self._channel_lost(exc, where, message)
            if result.retryable and result.error is not None:  # the connection, not the message
                return PublishResult.hand_back(result.error, "unreachable")
            return result
        except Exception as exc:
            return PublishResult.retry(f"rabbitmq: {describe(exc)}", type(exc).__name__)
        if isinstance(confirmation, aiormq.spec.Basic.Ack):
            return PublishResult.success()
        if isinstance(confirmation, aiormq.abc.DeliveredMessage):
            reply = getattr(confirmation.delivery, "reply_text", "") or "NO_ROUTE"
            return PublishResult.retry(
                f"rabbitmq: unroutable, returned by the broker ({reply}): no queue is bound to"
                f" {where}; bind a queue (or fix the route) and the event is retried",
                "unroutable",
            )
        return PublishResult.retry(
            f"rabbitmq: unexpected confirmation {type(confirmation).__name__} for {where}",
            "no_ack",
        )

    def _amqp_message(self, message: OutboundMessage) -> aio_pika.Message:
        """The AMQP message for an event (the Celery publisher sends a task message)."""
        return _message(message)

    def _too_large(self, amqp_message: aio_pika.Message) -> PublishResult | None:
        """The dead letter of a message the broker would refuse for its size, or None.

        Two limits: the body against ``max_message_size`` (RabbitMQ counts the body
        only), and the properties with the headers against ``frame_max``, since a content
        header frame cannot be split.
        """
        size = len(amqp_message.body)
        limit = self._max_message_bytes or self._server_max_message_bytes
        if size > limit:
            named = (
                f"max_message_bytes={limit} (the broker's max_message_size)"
                if self._max_message_bytes
                else "the broker's max_message_size"
            )
            return too_large(
                "rabbitmq",
                size,
                "(its body)",
                named,
                limit,
                "raise max_message_size in rabbitmq.conf and max_message_bytes= in the"
                " relay's broker URL, or send less",
            )
        frame_max = self._frame_max
        if frame_max:
            headers = amqp_message.headers or {}
            chars = sum(map(len, headers)) + sum(len(str(v)) for v in headers.values())
            if 4 * chars + 6 * len(headers) + _HEADER_FRAME_BOUND > frame_max:
                frame = _CONTENT_HEADER_FRAME + len(amqp_message.properties.marshal())
                if frame > frame_max:
                    return too_large(
                        "rabbitmq",
                        frame,
                        "of properties and headers (one content header frame)",
                        "the connection's frame_max",
                        frame_max,
                        "send fewer or shorter headers, or raise frame_max on the broker",
                    )
        return None

    def _channel_lost(
        self, exc: BaseException, where: str, message: OutboundMessage
    ) -> PublishResult:
        text = describe(exc)
        oversized = _OVERSIZED.search(str(exc))
        if oversized:
            # The broker closed the channel over a message over its max_message_size
            # (configured below what the publisher assumed): learn its limit.
            limit = _configured_max(str(exc))
            if limit is not None and not self._max_message_bytes:
                self._server_max_message_bytes = min(self._server_max_message_bytes, limit)
            if int(oversized.group(1)) == len(message.payload):
                return PublishResult.permanent(f"rabbitmq: {text}", "message_too_large")
            # Another message broke the channel: this one was never judged.
            return PublishResult.hand_back(
                f"rabbitmq: the broker closed the channel over another, oversized message"
                f" ({text}); published again",
                "channel_closed",
            )
        if isinstance(exc, aiormq.exceptions.ChannelNotFoundEntity):
            return PublishResult.retry(
                f"rabbitmq: {text} — does the exchange exist? ({where})", "not_found"
            )
        if isinstance(exc, aiormq.exceptions.ChannelInvalidStateError):
            # Sent on (or after) a channel some earlier failure closed: never judged.
            return PublishResult.hand_back(
                f"rabbitmq: channel closed before the broker confirmed: {text}", "channel_closed"
            )
        return PublishResult.retry(
            f"rabbitmq: connection or channel lost: {text}", "channel_closed"
        )


def _message(message: OutboundMessage) -> aio_pika.Message:
    return aio_pika.Message(
        message.payload,
        headers=encode_headers(message),
        content_type=message.content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=str(message.event_id),
        timestamp=message.time,  # when the event occurred, as on every broker
        type=message.event_type,
        app_id="outboxkit",
    )


def _configured_max(text: str) -> int | None:
    """The limit quoted by RabbitMQ's "message size N is larger than configured max size M"."""
    found = _CONFIGURED_MAX.search(text)
    return int(found.group(1)) if found else None


_CONFIGURED_MAX = re.compile(r"larger than configured max size (\d+)")


def _is_open(connection: AbstractConnection | None) -> bool:
    # aio-pika marks a connection closed only when close() is called; a connection the
    # broker or the network dropped shows on the underlying aiormq connection.
    if connection is None or connection.is_closed or connection.transport is None:
        return False
    return not connection.transport.connection.is_closed


def _parse_bool(key: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"rabbitmq URL option {key}={value!r} must be true or false")
