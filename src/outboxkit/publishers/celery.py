"""Celery task messages from the outbox: ``celery+amqp://`` (RabbitMQ) and ``celery+redis://``.

Events written by ``outboxkit.contrib.celery.send_task`` are published in Celery's
message protocol 2 (``wire/celery.py``) to the queue named by the event's topic, the
way Celery's default routing sends ``apply_async(queue=...)``: so a stock ``celery
worker`` consuming that queue runs them. Both publishers are the RabbitMQ and Redis
publishers (connections, confirms, limits, outages) with another message and route:

* RabbitMQ: the queue is declared as Celery declares it (a durable queue bound with
  routing key = its name to a durable direct exchange of the same name), then the
  task is published there with publisher confirms, persistent, ``mandatory``.
* Redis: kombu's Redis transport is a list per queue (``LPUSH``, the worker
  ``BRPOP``\\s) holding kombu's JSON envelope; not a Redis stream.

An event that is not a task (no Celery id: another writer's event in this outbox) is
dead-lettered at once: a Celery relay reads an outbox of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from typing import Any, cast

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange

from outboxkit._redact import redact
from outboxkit._text import describe
from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.publishers.rabbitmq import RabbitMQPublisher
from outboxkit.publishers.redis import RedisStreamsPublisher
from outboxkit.publishers.reserved import Guard
from outboxkit.wire import celery as wire

SCHEME_PREFIX = "celery+"


def _not_a_task(message: OutboundMessage) -> PublishResult:
    return PublishResult.permanent(
        f"celery: event {message.event_id} ({message.event_type!r}) is not a Celery task"
        " (no celery-id header): a celery+ relay publishes only what"
        " outboxkit.contrib.celery.send_task wrote; give send_task an outbox= of its own",
        "not_a_task",
    )


async def _split(
    messages: Sequence[OutboundMessage],
    publish: Any,
) -> list[PublishResult]:
    """Publish the task messages through ``publish``; the others are dead letters."""
    results: list[PublishResult | None] = [None] * len(messages)
    tasks: list[int] = []
    for i, message in enumerate(messages):
        if wire.is_task(message):
            tasks.append(i)
        else:
            results[i] = _not_a_task(message)
    if tasks:
        published = await publish([messages[i] for i in tasks])
        for i, result in zip(tasks, published, strict=True):
            results[i] = result
    return [r for r in results if r is not None]


def _strip_scheme(url: str) -> str:
    if not url.lower().startswith(SCHEME_PREFIX):
        raise ConfigurationError(f"not a celery+ broker URL: {redact(url)}")
    return url[len(SCHEME_PREFIX) :]


class CeleryAmqpPublisher(RabbitMQPublisher):
    """Celery tasks to RabbitMQ: exchange and routing key as Celery's default routing."""

    name = "celery-amqp"
    _unrestricted_warning = (
        "celery+amqp publisher without allow=: a send_task queue= can name (and declare)"
        " any queue of the vhost; set allow=QUEUE,... in the broker URL to the queues your"
        " workers consume (docs/celery.md)"
    )

    def __init__(self, url: str, *, declare: bool = True, **options: Any) -> None:
        for option in ("exchange", "exchange_type", "routing_key_prefix"):
            if options.get(option):
                raise ConfigurationError(
                    f"celery+amqp URL option {option}= is not used: a task goes to the direct"
                    " exchange named after its queue with routing key = the queue, as Celery's"
                    " default routing sends it"
                )
        super().__init__(url, exchange="", **options)
        self.guard = Guard("rabbitmq")
        self._declare_queues = declare
        self._queues: dict[str, AbstractExchange] = {}
        self._queues_channel: AbstractChannel | None = None

    @classmethod
    def from_url(cls, url: str) -> CeleryAmqpPublisher:
        """``celery+amqp://user:pass@host:5672/vhost``: the amqp:// publisher's options.

        ``declare=false`` when the relay's user may not declare queues (a worker or an
        operator declares them); ``exchange=`` and ``exchange_type=`` are refused.
        """
        return cast(CeleryAmqpPublisher, super().from_url(_strip_scheme(url)))

    def __repr__(self) -> str:
        return f"CeleryAmqpPublisher(url={redact(self._url)!r})"

    def _amqp_message(self, message: OutboundMessage) -> aio_pika.Message:
        return aio_pika.Message(
            message.payload,
            headers=wire.task_headers(message),
            content_type=wire.CONTENT_TYPE,
            content_encoding=wire.CONTENT_ENCODING,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            correlation_id=message.headers[wire.TASK_ID],
            priority=0,
        )

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        return await _split(messages, self._publish_tasks)

    async def _publish_tasks(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        default = await self._ensure_exchange()  # the connection and channel, reopened if lost
        channel = self._channel
        assert channel is not None
        if channel is not self._queues_channel:
            self._queues, self._queues_channel = {}, channel
        for queue in dict.fromkeys(m.topic for m in messages if self._may_declare(m)):
            if queue in self._queues:
                continue
            try:
                self._queues[queue] = await self._open_queue(channel, queue)
            except Exception as exc:
                # A refused declaration closes the channel: the next batch opens another.
                self._channel = None
                with contextlib.suppress(Exception):
                    await channel.close()
                failed = PublishResult.retry(
                    f"celery+amqp: could not declare queue {queue!r} as Celery does (a durable"
                    f" queue bound to the direct exchange {queue!r}): {describe(exc)}; if the"
                    " queue has other settings (x-max-priority, quorum), let a worker declare"
                    " it and set declare=false in the broker URL",
                    "declare_failed",
                )
                return [failed] * len(messages)
        # A queue not allowed (allow=, a system name) was not declared: _publish_one refuses
        # it before it would use the exchange.
        results = await asyncio.gather(
            *(self._publish_one(self._queues.get(m.topic, default), m) for m in messages)
        )
        return list(results)

    def _may_declare(self, message: OutboundMessage) -> bool:
        """Whether the message's queue is one this relay may publish to (and so declare)."""
        queue, _refused = self.destinations.resolve(message.topic)
        return queue is not None and self.guard.refuse(message, queue) is None

    async def _open_queue(self, channel: AbstractChannel, queue: str) -> AbstractExchange:
        if not self._declare_queues:
            return await channel.get_exchange(queue, ensure=False)
        exchange = await channel.declare_exchange(
            queue, aio_pika.ExchangeType.DIRECT, durable=True, timeout=self._timeout
        )
        declared = await channel.declare_queue(queue, durable=True, timeout=self._timeout)
        await declared.bind(exchange, routing_key=queue, timeout=self._timeout)
        return exchange


class CeleryRedisPublisher(RedisStreamsPublisher):
    """Celery tasks to Redis as kombu's Redis transport queues them: LPUSH onto a list."""

    name = "celery-redis"
    _key_kind = "a list (a kombu queue)"
    _unrestricted_warning = (
        "celery+redis publisher without allow=: a send_task queue= can name any key of the"
        " database, and a task is pushed onto it; set allow=QUEUE,... in the broker URL to the"
        " queues your workers consume (docs/celery.md)"
    )

    def __init__(self, url: str, **options: Any) -> None:
        for option in ("maxlen", "dedup_window", "stream_prefix"):
            if options.get(option):
                raise ConfigurationError(
                    f"celery+redis URL option {option}= is for Redis streams; a Celery queue"
                    " is a kombu list named after the queue"
                )
        super().__init__(url, **options)
        self.guard = Guard("redis")

    @classmethod
    def from_url(cls, url: str) -> CeleryRedisPublisher:
        """``celery+redis://[:password@]host:6379/0``, the database the workers' broker URL names.

        Takes the redis:// publisher's ``allow=``, ``timeout``, ``wait_replicas`` and client
        options.
        """
        return cast(CeleryRedisPublisher, super().from_url(_strip_scheme(url)))

    def __repr__(self) -> str:
        return f"CeleryRedisPublisher(url={redact(self._url)!r})"

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        if not messages:
            return []
        return await _split(messages, super().publish_batch)

    def _encode(self, message: OutboundMessage, stream: str) -> dict[str, bytes | str]:
        # A fresh delivery tag per publish, as kombu's channel gives every message one.
        return {"data": wire.redis_envelope(message, stream, delivery_tag=str(uuid.uuid4()))}

    def _queue(
        self, pipe: Any, message: OutboundMessage, stream: str, fields: dict[str, bytes | str]
    ) -> None:
        pipe.lpush(stream, fields["data"])
