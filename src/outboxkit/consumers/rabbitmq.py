"""RabbitMQ runner: aio-pika, manual acknowledgements only after the database commit.

A failed delivery is requeued (``nack``) after a backoff delay. Once it has
been delivered ``max_deliveries`` times it is rejected without requeue, which
RabbitMQ routes to the queue's dead-letter exchange (``dead_letter_exchange=``
when the runner declares the queue, or the queue's own ``x-dead-letter-exchange``).
A queue the runner declares without one is never rejected into (RabbitMQ
would drop the message): the message keeps being requeued, with an error log.
Delivery counts come from quorum queues' ``x-delivery-count`` header; on
classic queues the runner counts failures itself (per process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from outboxkit.errors import missing_extra

try:
    import aio_pika
    from aio_pika.abc import AbstractIncomingMessage, AbstractMessage
except ModuleNotFoundError as exc:  # one line naming the extra, not a traceback
    raise missing_extra(exc, "outboxkit.consumers.rabbitmq") from exc

from outboxkit._redact import redact
from outboxkit.consumers.base import (
    ConsumerRunner,
    Handler,
    ReceivedEvent,
    unwrap,
)
from outboxkit.errors import ConfigurationError, EnvelopeError
from outboxkit.inbox import Inbox
from outboxkit.wire import rabbitmq as wire

log = logging.getLogger("outboxkit.consumer.rabbitmq")


def decode(message: AbstractMessage, routing_key: str, delivery_count: int = 1) -> ReceivedEvent:
    """The event in an AMQP message sent by the RabbitMQ publisher (routing key = topic).

    Attribute values are UTF-8 strings as they are (no percent-encoding in AMQP);
    a native AMQP timestamp for ``time`` is accepted too, as the binding requires.
    """
    return unwrap(
        routing_key,
        lambda: wire.decode(
            message.body,
            message.headers,
            content_type=message.content_type,
            message_type=message.type,
            message_id=message.message_id,
        ),
        delivery_count,
    )


class RabbitMQConsumer(ConsumerRunner):
    """Consumes ``queue``; with ``exchange=`` it declares the queue durable and binds it.

    ``routing_keys`` are the binding patterns (topic exchange: ``orders.#``).
    ``declare=False`` uses a queue an operator declared, as it is.
    """

    broker = "rabbitmq"

    def __init__(
        self,
        dsn: str,
        handler: Handler,
        *,
        consumer: str,
        url: str,
        queue: str,
        exchange: str | None = None,
        exchange_type: str = "topic",
        routing_keys: tuple[str, ...] | list[str] = ("#",),
        dead_letter_exchange: str | None = None,
        queue_arguments: dict[str, Any] | None = None,
        declare: bool = True,
        inbox: Inbox | None = None,
        max_deliveries: int = 5,
        retry_delay: float = 1.0,
        prefetch: int = 10,
    ) -> None:
        super().__init__(
            dsn,
            handler,
            consumer=consumer,
            inbox=inbox,
            max_deliveries=max_deliveries,
            retry_delay=retry_delay,
        )
        if not queue:
            raise ConfigurationError("rabbitmq consumer needs queue=")
        self.url = url
        self.queue = queue
        self.exchange = exchange
        self.exchange_type = exchange_type
        self.routing_keys = list(routing_keys)
        self.dead_letter_exchange = dead_letter_exchange
        self.queue_arguments = dict(queue_arguments or {})
        self.declare = declare
        self.prefetch = prefetch
        # Rejecting a message drops it unless its queue has a dead-letter exchange: reject
        # only when one is configured (or the queue is the operator's, with its policies).
        self._can_dead_letter = (
            not declare
            or dead_letter_exchange is not None
            or "x-dead-letter-exchange" in self.queue_arguments
        )
        self._failures: dict[str, int] = {}
        self._in_flight: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Consume until :meth:`stop`; unacknowledged messages go back to the queue on close."""
        connection = await aio_pika.connect_robust(self.url, timeout=5)
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=self.prefetch)
            queue = await self._queue(channel)
            tag = await queue.consume(self._on_message, no_ack=False)
            await self._stopping.wait()
            with contextlib.suppress(Exception):
                await queue.cancel(tag)
            if self._in_flight:
                await asyncio.wait(self._in_flight, timeout=30)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 5.0)
            await self._close_db()

    async def _queue(self, channel: aio_pika.abc.AbstractChannel) -> aio_pika.abc.AbstractQueue:
        if not self.declare:
            return await channel.get_queue(self.queue, ensure=True)
        arguments = dict(self.queue_arguments)
        if self.dead_letter_exchange is not None:
            arguments.setdefault("x-dead-letter-exchange", self.dead_letter_exchange)
        queue = await channel.declare_queue(self.queue, durable=True, arguments=arguments or None)
        if self.exchange:
            await channel.declare_exchange(self.exchange, self.exchange_type, durable=True)
            for pattern in self.routing_keys:
                await queue.bind(self.exchange, pattern)
        return queue

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._in_flight.add(task)
        try:
            await self._handle(message)
        finally:
            if task is not None:
                self._in_flight.discard(task)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        ident = message.message_id or str(message.delivery_tag)
        delivered = self._delivery_count(message, ident)
        try:
            event = decode(message, message.routing_key or "", delivered)
        except EnvelopeError as exc:
            log.error(
                "rabbitmq consumer %r: rejecting a message: %s", self.consumer, redact(str(exc))
            )
            await message.reject(requeue=False)
            return
        if await self._apply(event):
            self._failures.pop(ident, None)
            await message.ack()
            return
        self._failures[ident] = self._failures.get(ident, 0) + 1
        if delivered >= self.max_deliveries and self._can_dead_letter:
            self._failures.pop(ident, None)
            self.stats.dead_lettered += 1
            log.warning(
                "rabbitmq consumer %r: event %s failed %d deliveries; rejected to the"
                " queue's dead-letter exchange",
                self.consumer,
                event.event_id,
                delivered,
            )
            await message.reject(requeue=False)
            return
        if delivered >= self.max_deliveries:
            log.error(
                "rabbitmq consumer %r: event %s failed %d deliveries and queue %r has no"
                " dead-letter exchange (set dead_letter_exchange=): requeued again",
                self.consumer,
                event.event_id,
                delivered,
                self.queue,
            )
        # Hold the message (other deliveries go on meanwhile), then hand it back.
        await self._sleep_or_stop(self._backoff(delivered))
        await message.nack(requeue=True)

    def _delivery_count(self, message: AbstractIncomingMessage, ident: str) -> int:
        from_broker = (message.headers or {}).get("x-delivery-count")
        counted = self._failures.get(ident, 0) + 1
        if isinstance(from_broker, int):
            return max(from_broker + 1, counted)
        return counted
