"""NATS JetStream runner: a durable pull consumer, acked only after the database commit.

A failed delivery is ``nak``-ed with a backoff delay; JetStream redelivers it.
After ``max_deliveries`` failed deliveries the message is published to the
dead-letter subject (stored by a stream you own, confirmed by its PubAck) and
then terminated, so it is never redelivered again.

The runner sends its own pull requests instead of nats-py's ``fetch()``: that one
takes any message carrying a ``Status`` header for a status of the server, so a
stored message with ``Status: 404`` or ``408`` was dropped unhandled and one with
``Status: 500`` made the whole fetch raise, its healthy messages with it. Here a
stream message is told from a server status by its ``$JS.ACK.`` reply subject,
whatever its headers say.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson

from outboxkit.errors import missing_extra

try:
    import nats
    import nats.errors
    import nats.js.errors
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
except ModuleNotFoundError as exc:  # one line naming the extra, not a traceback
    raise missing_extra(exc, "outboxkit.consumers.nats") from exc

from outboxkit._redact import redact
from outboxkit.consumers.base import (
    ConsumerRunner,
    Handler,
    ReceivedEvent,
    unwrap,
)
from outboxkit.errors import ConfigurationError, EnvelopeError
from outboxkit.inbox import Inbox
from outboxkit.wire import nats as wire

log = logging.getLogger("outboxkit.consumer.nats")

_ACK_TIMEOUT = 5.0
# A delivered stream message's reply subject; the server's statuses have none.
_ACK_PREFIX = "$JS.ACK."
# Statuses that end a pull request without an error worth a line: no messages, expired,
# and 409 (a request limit reached, a leadership change).
_QUIET_STATUSES = frozenset({"404", "408", "409"})
# How much longer than the request's expiry the runner waits for its last message.
_FETCH_MARGIN = 0.5
_STATUS_RENAMED = {
    "Status": "outboxkit-original-Status",
    "Description": "outboxkit-original-Description",
}


def decode(
    subject: str, data: bytes, headers: dict[str, str] | None, delivery_count: int = 1
) -> ReceivedEvent:
    """The event in a JetStream message published by the NATS publisher (``ce-*`` headers).

    Attribute values are percent-decoded as the NATS binding requires; a value
    whose encoded bytes are not UTF-8 makes the message an :class:`EnvelopeError`.
    """
    return unwrap(subject, lambda: wire.decode(data, headers), delivery_count)


class NatsConsumer(ConsumerRunner):
    """Consumes ``subject`` from ``stream`` with the durable pull consumer ``durable``.

    ``await NatsConsumer(dsn, handler, consumer="billing", servers="nats://127.0.0.1:4222",
    stream="ORDERS", subject="orders.>").run()`` runs until :meth:`stop`.
    The durable consumer is created if missing (explicit acks, ``max_deliver``
    one above ``max_deliveries`` so the last failed delivery is still ours to
    dead-letter).
    """

    broker = "nats"

    def __init__(
        self,
        dsn: str,
        handler: Handler,
        *,
        consumer: str,
        servers: str | list[str],
        stream: str,
        subject: str,
        durable: str | None = None,
        dead_letter_subject: str | None = None,
        inbox: Inbox | None = None,
        max_deliveries: int = 5,
        retry_delay: float = 1.0,
        ack_wait: float = 30.0,
        batch: int = 10,
        fetch_timeout: float = 1.0,
    ) -> None:
        super().__init__(
            dsn,
            handler,
            consumer=consumer,
            inbox=inbox,
            max_deliveries=max_deliveries,
            retry_delay=retry_delay,
        )
        if not stream or not subject:
            raise ConfigurationError("nats consumer needs stream= and subject=")
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.stream = stream
        self.subject = subject
        self.durable = durable or consumer.replace(".", "_").replace(" ", "_")
        self.dead_letter_subject = dead_letter_subject
        self.ack_wait = ack_wait
        self.batch = batch
        self.fetch_timeout = fetch_timeout
        self._js: Any = None

    async def run(self) -> None:
        """Fetch, apply and acknowledge until :meth:`stop` is called."""
        nc = await nats.connect(
            self.servers,
            name=f"outboxkit-consumer-{self.consumer}",
            connect_timeout=5,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
        )
        try:
            self._js = nc.jetstream(timeout=10.0)
            await self._ensure_consumer()
            sub = await nc.subscribe(nc.new_inbox())
            pull = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}"
            while not self.stopping:
                try:
                    messages = await self._fetch(nc, sub, pull)
                except nats.errors.ConnectionClosedError:
                    raise
                except Exception as exc:
                    log.warning("nats fetch failed: %s", redact(str(exc) or type(exc).__name__))
                    await self._sleep_or_stop(0.5)
                    continue
                for msg in messages:
                    await self._handle(msg)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5.0)
            await self._close_db()

    async def _ensure_consumer(self) -> None:
        """Create the durable pull consumer if it does not exist (an existing one is kept)."""
        try:
            await self._js.consumer_info(self.stream, self.durable)
        except nats.js.errors.NotFoundError:
            await self._js.add_consumer(
                self.stream,
                config=ConsumerConfig(
                    name=self.durable,
                    durable_name=self.durable,
                    filter_subject=self.subject,
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    max_deliver=self.max_deliveries + 1,
                    ack_wait=self.ack_wait,
                ),
            )

    async def _fetch(self, nc: Any, sub: Any, pull: str) -> list[Any]:
        """One pull request: up to ``batch`` stream messages, none if nothing came in time.

        A message left over from an earlier request (it arrived after that one's wait
        ended) is a delivery like any other and is returned here.
        """
        request = {"batch": self.batch, "expires": int(self.fetch_timeout * 1e9)}
        await nc.publish(pull, orjson.dumps(request), reply=sub.subject)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.fetch_timeout + _FETCH_MARGIN
        messages: list[Any] = []
        while len(messages) < self.batch:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                msg = await sub.next_msg(timeout=remaining)
            except (TimeoutError, nats.errors.TimeoutError):
                break
            if msg.reply and msg.reply.startswith(_ACK_PREFIX):
                messages.append(msg)
                continue
            status = (msg.headers or {}).get("Status", "")
            if status == "100":  # a heartbeat: the request goes on
                continue
            if status in ("404", "408"):
                break  # nothing (more) to deliver: the request is over
            if status not in _QUIET_STATUSES:
                log.warning(
                    "nats consumer %r: pull request answered %s %s",
                    self.consumer,
                    status or "without a status",
                    (msg.headers or {}).get("Description", ""),
                )
            if not messages:  # refused at once (limits, no consumer): do not spin
                await self._sleep_or_stop(_FETCH_MARGIN)
            break
        return messages

    async def _handle(self, msg: Any) -> None:
        delivered = int(msg.metadata.num_delivered or 1)
        try:
            event = decode(msg.subject, msg.data, msg.headers, delivered)
        except EnvelopeError as exc:
            await self._dead_letter(msg, str(exc))
            return
        if await self._apply(event):
            with contextlib.suppress(Exception):
                # Confirmed by the server; if the ack is lost the redelivery is a duplicate.
                await msg.ack_sync(timeout=_ACK_TIMEOUT)
            return
        if delivered >= self.max_deliveries and self.dead_letter_subject:
            await self._dead_letter(msg, f"failed {delivered} deliveries")
        else:
            with contextlib.suppress(Exception):
                await msg.nak(delay=self._backoff(delivered))

    async def _dead_letter(self, msg: Any, reason: str) -> None:
        if not self.dead_letter_subject:
            log.error(
                "nats consumer %r: dropping message %s on %s (%s); set dead_letter_subject=",
                self.consumer,
                msg.metadata.sequence.stream,
                msg.subject,
                reason,
            )
            with contextlib.suppress(Exception):
                await msg.term()
            return
        # Keep the dedup id; drop the publisher's Nats-Expected-* checks meant for its stream.
        # A stored Status/Description is kept renamed: a reader of the dead-letter stream
        # with nats-py's fetch() would take it for a server status.
        headers = {
            _STATUS_RENAMED.get(k, k): v
            for k, v in (msg.headers or {}).items()
            if not k.startswith("Nats-") or k == "Nats-Msg-Id"
        }
        headers.update(
            {
                "outboxkit-dead-letter-reason": reason,
                "outboxkit-consumer": self.consumer,
                "outboxkit-original-subject": msg.subject,
            }
        )
        try:
            await self._js.publish(self.dead_letter_subject, msg.data, headers=headers)
        except Exception as exc:
            # Not stored anywhere yet: let JetStream redeliver it rather than lose it.
            log.error(
                "nats consumer %r: cannot dead-letter to %r: %s",
                self.consumer,
                self.dead_letter_subject,
                redact(str(exc) or type(exc).__name__),
            )
            with contextlib.suppress(Exception):
                await msg.nak(delay=self._backoff(self.max_deliveries))
            return
        self.stats.dead_lettered += 1
        log.warning(
            "nats consumer %r: message on %s dead-lettered to %s (%s)",
            self.consumer,
            msg.subject,
            self.dead_letter_subject,
            reason,
        )
        with contextlib.suppress(Exception):
            await msg.term()
