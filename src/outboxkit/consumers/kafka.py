"""Kafka runner: confluent-kafka consumer group, offsets committed only after the database commit.

Auto-commit is off. A failed message is not skipped: the runner seeks its
partition back to it and tries again after a backoff (later messages of that
partition wait, which keeps per-key order). After ``max_deliveries`` failures
it is produced to ``dead_letter_topic`` (waiting for the delivery report) and
its offset committed; without a dead-letter topic it is retried forever.
The client is synchronous, so its calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from outboxkit.errors import missing_extra

try:
    from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
except ModuleNotFoundError as exc:  # one line naming the extra, not a traceback
    raise missing_extra(exc, "outboxkit.consumers.kafka") from exc

from outboxkit._redact import redact
from outboxkit.consumers.base import (
    ConsumerRunner,
    Handler,
    ReceivedEvent,
    from_envelope,
)
from outboxkit.errors import ConfigurationError, EnvelopeError
from outboxkit.inbox import Inbox
from outboxkit.wire import kafka as wire

log = logging.getLogger("outboxkit.consumer.kafka")


def decode(
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: list[tuple[str, bytes | None]] | None,
    delivery_count: int = 1,
) -> ReceivedEvent:
    """The event in a Kafka record produced by the Kafka publisher (``ce_*`` headers)."""
    return from_envelope(topic, wire.decode(key, value, headers), delivery_count)


class KafkaConsumer(ConsumerRunner):
    """Consumes ``topics`` in the consumer group ``group`` (default: the consumer name).

    ``config`` adds or overrides librdkafka properties (security, timeouts).
    """

    broker = "kafka"

    def __init__(
        self,
        dsn: str,
        handler: Handler,
        *,
        consumer: str,
        bootstrap: str,
        topics: str | list[str],
        group: str | None = None,
        dead_letter_topic: str | None = None,
        config: dict[str, Any] | None = None,
        inbox: Inbox | None = None,
        max_deliveries: int = 5,
        retry_delay: float = 1.0,
        poll_timeout: float = 0.5,
    ) -> None:
        super().__init__(
            dsn,
            handler,
            consumer=consumer,
            inbox=inbox,
            max_deliveries=max_deliveries,
            retry_delay=retry_delay,
        )
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        if not self.topics or not bootstrap:
            raise ConfigurationError("kafka consumer needs bootstrap= and at least one topic")
        self.bootstrap = bootstrap
        self.group = group or consumer
        self.dead_letter_topic = dead_letter_topic
        self.poll_timeout = poll_timeout
        self._config: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "group.id": self.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "client.id": f"outboxkit-consumer-{consumer}",
            # A topic created after the consumer started (the relay's first event creates
            # it) is found within 10 s instead of librdkafka's default 5 minutes.
            "topic.metadata.refresh.interval.ms": 10_000,
            **(config or {}),
        }
        self._failures: dict[tuple[str, int, int], int] = {}
        self._producer: Any = None

    async def run(self) -> None:
        """Poll, apply and commit until :meth:`stop`."""
        kafka = Consumer({**self._config, "logger": log})
        try:
            kafka.subscribe(self.topics)
            while not self.stopping:
                msg = await asyncio.to_thread(kafka.poll, self.poll_timeout)
                if msg is None:
                    continue
                error = msg.error()
                if error is not None:
                    if error.fatal():
                        raise RuntimeError(f"kafka consumer fatal error: {error.str()}")
                    if error.code() != KafkaError._PARTITION_EOF:
                        log.warning("kafka consumer %r: %s", self.consumer, error.str())
                    continue
                await self._handle(kafka, msg)
        finally:
            await asyncio.to_thread(kafka.close)
            if self._producer is not None:
                await asyncio.to_thread(self._producer.flush, 5.0)
            await self._close_db()

    async def _handle(self, kafka: Any, msg: Any) -> None:
        where = (msg.topic(), msg.partition(), msg.offset())
        delivered = self._failures.get(where, 0) + 1
        try:
            event = decode(msg.topic(), msg.key(), msg.value(), msg.headers(), delivered)
        except EnvelopeError as exc:
            await self._dead_letter_or_retry(kafka, msg, where, str(exc), force=True)
            return
        if await self._apply(event):
            self._failures.pop(where, None)
            await self._commit(kafka, msg)
            return
        self._failures[where] = delivered
        if delivered >= self.max_deliveries and self.dead_letter_topic:
            await self._dead_letter_or_retry(kafka, msg, where, f"failed {delivered} deliveries")
            return
        await self._retry_later(kafka, msg, delivered)

    async def _commit(self, kafka: Any, msg: Any) -> None:
        try:
            await asyncio.to_thread(kafka.commit, message=msg, asynchronous=False)
        except Exception as exc:
            # A rebalance took the partition: the new owner redelivers, the inbox skips it.
            log.warning(
                "kafka consumer %r: offset commit failed: %s", self.consumer, redact(str(exc))
            )

    async def _retry_later(self, kafka: Any, msg: Any, delivered: int) -> None:
        with contextlib.suppress(Exception):
            kafka.seek(TopicPartition(msg.topic(), msg.partition(), msg.offset()))
        await self._sleep_or_stop(self._backoff(delivered))

    async def _dead_letter_or_retry(
        self, kafka: Any, msg: Any, where: tuple[str, int, int], reason: str, *, force: bool = False
    ) -> None:
        if not self.dead_letter_topic:
            if force:  # not an outboxkit event and nowhere to put it: skip it, loudly
                log.error("kafka consumer %r: skipping %s: %s", self.consumer, where, reason)
                await self._commit(kafka, msg)
            return
        headers = list(msg.headers() or [])
        headers += [
            ("outboxkit-dead-letter-reason", reason.encode()),
            ("outboxkit-consumer", self.consumer.encode()),
            ("outboxkit-source", f"{where[0]}/{where[1]}/{where[2]}".encode()),
        ]
        try:
            await asyncio.to_thread(self._produce_confirmed, msg.key(), msg.value(), headers)
        except Exception as exc:
            log.error(
                "kafka consumer %r: cannot dead-letter %s: %s",
                self.consumer,
                where,
                redact(str(exc)),
            )
            await self._retry_later(kafka, msg, self.max_deliveries)
            return
        self._failures.pop(where, None)
        self.stats.dead_lettered += 1
        log.warning(
            "kafka consumer %r: %s dead-lettered to %s (%s)",
            self.consumer,
            where,
            self.dead_letter_topic,
            reason,
        )
        await self._commit(kafka, msg)

    def _produce_confirmed(
        self, key: bytes | None, value: bytes | None, headers: list[tuple[str, Any]]
    ) -> None:
        if self._producer is None:
            self._producer = Producer(
                {
                    "bootstrap.servers": self.bootstrap,
                    "enable.idempotence": True,
                    "acks": "all",
                    **{
                        k: v
                        for k, v in self._config.items()
                        if k.startswith(("security.", "sasl.", "ssl."))
                    },
                }
            )
        outcome: list[Any] = []
        self._producer.produce(
            self.dead_letter_topic,
            value=value,
            key=key,
            headers=headers,
            on_delivery=lambda err, _m: outcome.append(err),
        )
        self._producer.flush(15.0)
        if not outcome:
            raise TimeoutError("no delivery report within 15 s")
        if outcome[0] is not None:
            raise RuntimeError(outcome[0].str())
