"""One small harness per broker, so each delivery guarantee is written once for all of them.

A harness knows four things about its broker: the URL a relay publishes to, how to make a
fresh destination, how to read back what arrived (decoded by the consumer side's own
decoder, so the wire format is checked both ways), and how to cut and restore the link.
The scenarios in this package use nothing else.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import pytest

from outboxkit.consumers.base import ReceivedEvent, from_envelope
from tests.support.local_brokers import OwnRedis, rabbitmq_url
from tests.support.moto_sqs import MotoSqs
from tests.support.servers import consume_kafka, consume_nats, ensure_stream, unique_name
from tests.support.webhook_server import WebhookServer


class BrokerHarness(ABC):
    """A broker under test; ``cuttable=True`` routes the relay through something a test can cut."""

    name: ClassVar[str]
    #: The broker drops an event re-published under the same id (the relay's duplicates vanish).
    dedups: ClassVar[bool] = False
    #: Query options the in-process relay's publisher gets (short timeouts for outage tests).
    options: ClassVar[str] = ""
    #: What the dead letter of a 1 MiB payload names: the broker's default limit for a whole
    #: message, when headers + payload exceed it; None where such an event fits by default.
    default_limit: ClassVar[str | None] = None
    #: URL options that lower the broker's limit to 4 KiB, and the name the dead letter
    #: quotes; None where a test cannot lower it.
    small_limit: ClassVar[tuple[str, str] | None] = None

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.request = request
        self.tmp_path = tmp_path

    async def open(self, *, cuttable: bool) -> None:
        """Start what this test needs (its own server where the broker is cut by stopping it)."""
        await self._open(cuttable)
        self.opened = True

    async def close(self) -> None:
        """Stop what :meth:`open` started and delete the test's destinations."""
        if getattr(self, "opened", False):
            await self._close()

    @abstractmethod
    async def _open(self, cuttable: bool) -> None: ...

    async def _close(self) -> None:  # noqa: B027 - not every harness has something to stop
        pass

    @abstractmethod
    async def destination(self) -> str:
        """A fresh topic the relay can publish to and this harness can read back."""

    @property
    @abstractmethod
    def url(self) -> str:
        """The broker URL a relay process publishes to (plain, no test timeouts)."""

    @property
    def publisher_url(self) -> str:
        """The URL for an in-process relay: :attr:`url` plus :attr:`options`."""
        if not self.options:
            return self.url
        return self.url + ("&" if "?" in self.url else "?") + self.options

    @abstractmethod
    async def published(self, topic: str) -> int:
        """How many messages reached the broker, read without consuming them."""

    @abstractmethod
    async def received(self, topic: str, n: int, timeout: float = 20.0) -> list[ReceivedEvent]:
        """Everything that arrived on ``topic`` (at least ``n``, unless time ran out), decoded."""

    @abstractmethod
    async def cut(self) -> None:
        """Take the broker away from the relay (only after ``open(cuttable=True)``)."""

    @abstractmethod
    async def restore(self) -> None:
        """Give the broker back after :meth:`cut`."""

    #: :meth:`pause` works: the link passes through a proxy that can hold bytes.
    pausable: ClassVar[bool] = False

    async def pause(self) -> None:
        """Hold every byte between relay and broker, connections left open (then cut/restore)."""
        raise NotImplementedError(f"{self.name}: the link cannot be paused")


class KafkaHarness(BrokerHarness):
    name = "kafka"
    default_limit = "message.max.bytes"
    small_limit = ("message.max.bytes=4096", "message.max.bytes")

    async def _open(self, cuttable: bool) -> None:
        self._proxied = self.request.getfixturevalue("kafka_behind_proxy") if cuttable else None
        self._broker = self._proxied or self.request.getfixturevalue("kafka_broker")

    async def destination(self) -> str:
        return f"contract-{uuid.uuid4().hex[:8]}"

    @property
    def url(self) -> str:
        return str(self._broker.url)

    async def published(self, topic: str) -> int:
        return len(
            await asyncio.to_thread(consume_kafka, self._broker.bootstrap, topic, 10**6, 1.0)
        )

    async def received(self, topic: str, n: int, timeout: float = 20.0) -> list[ReceivedEvent]:
        from outboxkit.consumers.kafka import decode

        bootstrap = self._broker.bootstrap
        got = await asyncio.to_thread(consume_kafka, bootstrap, topic, n, timeout)
        # Then everything for a moment: duplicates beyond `n` must be seen too.
        everything = await asyncio.to_thread(consume_kafka, bootstrap, topic, 10**6, 2.0)
        got = everything if len(everything) >= len(got) else got
        return [decode(m.topic(), m.key(), m.value(), m.headers()) for m in got]

    async def cut(self) -> None:
        assert self._proxied is not None, "open(cuttable=True) first"
        self._proxied.proxy.cut()

    async def restore(self) -> None:
        assert self._proxied is not None, "open(cuttable=True) first"
        self._proxied.proxy.resume()

    pausable = True

    async def pause(self) -> None:
        assert self._proxied is not None, "open(cuttable=True) first"
        self._proxied.proxy.pause()


class NatsHarness(BrokerHarness):
    name = "nats"
    default_limit = "max_payload"
    dedups = True  # JetStream's duplicate window, keyed by Nats-Msg-Id
    options = "timeout=0.5"

    async def _open(self, cuttable: bool) -> None:
        self._server_url = str(self.request.getfixturevalue("nats_server").url)
        self._proxy = None
        if cuttable:
            parts = urlsplit(self._server_url)
            self._proxy = self.request.getfixturevalue("proxy_factory")(
                parts.hostname or "127.0.0.1", parts.port or 4222
            )
        self._streams: dict[str, str] = {}

    async def destination(self) -> str:
        suffix = uuid.uuid4().hex[:8]
        stream = f"CONTRACT{suffix.upper()}"
        await ensure_stream(self._server_url, stream, [f"contract{suffix}.>"])
        subject = f"contract{suffix}.orders"
        self._streams[subject] = stream
        return subject

    @property
    def url(self) -> str:
        return self._server_url if self._proxy is None else f"nats://127.0.0.1:{self._proxy.port}"

    async def published(self, topic: str) -> int:
        return len(await consume_nats(self._server_url, self._streams[topic], topic, None))

    async def received(self, topic: str, n: int, timeout: float = 20.0) -> list[ReceivedEvent]:
        from outboxkit.consumers.nats import decode

        stream = self._streams[topic]
        got = await consume_nats(self._server_url, stream, topic, n, timeout)
        # Then everything the stream stores (read once the relays stopped): duplicates
        # beyond `n` must be seen too.
        everything = await consume_nats(self._server_url, stream, topic, None)
        got = everything if len(everything) >= len(got) else got
        return [decode(m.subject, m.data, m.headers) for m in got]

    async def cut(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    async def restore(self) -> None:
        assert self._proxy is not None
        self._proxy.resume()

    pausable = True

    async def pause(self) -> None:
        assert self._proxy is not None
        self._proxy.pause()


class RabbitMQHarness(BrokerHarness):
    """One exchange of the machine's RabbitMQ per test, a queue bound per destination."""

    name = "rabbitmq"
    small_limit = ("max_message_bytes=4096", "max_message_bytes")
    options = "timeout=2"

    async def _open(self, cuttable: bool) -> None:
        import aio_pika

        self._server_url = rabbitmq_url()
        self._connection = await aio_pika.connect(self._server_url, timeout=10)
        self._channel = await self._connection.channel()
        self._exchange = unique_name("outboxkit-contract")
        self._queues: dict[str, Any] = {}
        parts = urlsplit(self._server_url)
        self._proxy = None
        if cuttable:
            self._proxy = self.request.getfixturevalue("proxy_factory")(
                parts.hostname or "127.0.0.1", parts.port or 5672
            )

    async def _close(self) -> None:
        for queue in self._queues.values():
            await queue.delete(if_unused=False, if_empty=False)
        await self._channel.exchange_delete(self._exchange)
        await self._connection.close()

    async def destination(self) -> str:
        topic = f"orders.{uuid.uuid4().hex[:8]}"
        await self._channel.declare_exchange(self._exchange, "topic", durable=True)
        queue = await self._channel.declare_queue(unique_name("outboxkit-contract-q"), durable=True)
        await queue.bind(self._exchange, topic)
        self._queues[topic] = queue
        return topic

    @property
    def url(self) -> str:
        parts = urlsplit(self._server_url)
        netloc = parts.netloc
        if self._proxy is not None:
            netloc = f"{netloc.rsplit(':', 1)[0]}:{self._proxy.port}"
        return f"{parts.scheme}://{netloc}{parts.path or '/'}?exchange={self._exchange}"

    async def published(self, topic: str) -> int:
        declared = await self._channel.declare_queue(self._queues[topic].name, passive=True)
        return int(declared.declaration_result.message_count or 0)

    async def received(self, topic: str, n: int, timeout: float = 20.0) -> list[ReceivedEvent]:
        from outboxkit.consumers.rabbitmq import decode

        queue = self._queues[topic]
        deadline = time.monotonic() + timeout
        got: list[ReceivedEvent] = []
        while time.monotonic() < deadline:
            message = await queue.get(no_ack=True, fail=False)
            if message is not None:
                got.append(decode(message, message.routing_key or topic))
            elif len(got) >= n:
                break
            else:
                await asyncio.sleep(0.05)
        return got

    async def cut(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    async def restore(self) -> None:
        assert self._proxy is not None
        self._proxy.resume()

    pausable = True

    async def pause(self) -> None:
        assert self._proxy is not None
        self._proxy.pause()


class RedisHarness(BrokerHarness):
    """A redis-server of the test's own (``appendfsync always``): an outage is a SIGKILL."""

    name = "redis"
    options = "timeout=1"
    query = ""

    async def _open(self, cuttable: bool) -> None:
        import redis.asyncio

        self._server = OwnRedis(self.tmp_path / "redis")
        self._server.start()
        self._client: Any = redis.asyncio.Redis.from_url(self._server.url)

    async def _close(self) -> None:
        await self._client.aclose()
        self._server.kill()

    async def destination(self) -> str:
        return unique_name("contract-orders")

    @property
    def url(self) -> str:
        return self._server.url + (f"?{self.query}" if self.query else "")

    async def published(self, topic: str) -> int:
        return int(await self._client.xlen(topic))

    async def received(self, topic: str, n: int, timeout: float = 20.0) -> list[ReceivedEvent]:
        from outboxkit.consumers.redis import decode

        deadline = time.monotonic() + timeout
        while await self.published(topic) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return [decode(topic, fields) for _id, fields in await self._client.xrange(topic)]

    async def cut(self) -> None:
        self._server.kill()

    async def restore(self) -> None:
        self._server.start()


class RedisDedupHarness(RedisHarness):
    name = "redis-dedup"
    dedups = True  # the dedup script's SET NX per event id
    query = "dedup_window=300"


class SqsHarness(BrokerHarness):
    """moto's SQS server of the test's own: an outage stops it, its queues survive."""

    name = "sqs"
    default_limit = "MaximumMessageSize"
    small_limit = ("max_message_bytes=4096", "max_message_bytes")
    options = "timeout=2"
    suffix = ""

    async def _open(self, cuttable: bool) -> None:
        monkeypatch = self.request.getfixturevalue("monkeypatch")
        # Dummy credentials through the normal boto3 chain; relay processes inherit them.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        self._server = MotoSqs()
        await asyncio.to_thread(self._server.start)
        self._queue = unique_name("orders") + self.suffix
        self._queue_url = await asyncio.to_thread(self._server.create_queue, self._queue)

    async def _close(self) -> None:
        await asyncio.to_thread(self._server.stop)

    async def destination(self) -> str:
        return "orders"  # the queue is in the URL; the topic only labels the event

    @property
    def url(self) -> str:
        return self._server.url(self._queue)

    async def published(self, topic: str) -> int:
        return await asyncio.to_thread(self._server.depth, self._queue_url)

    async def received(self, topic: str, n: int, timeout: float = 20.0) -> list[ReceivedEvent]:
        from outboxkit.consumers.sqs import decode

        deadline = time.monotonic() + timeout
        while await self.published(topic) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        drained = await asyncio.to_thread(self._server.drain, self._queue_url)
        return [decode(self._queue, m) for m in drained]

    async def cut(self) -> None:
        await asyncio.to_thread(self._server.stop)

    async def restore(self) -> None:
        await asyncio.to_thread(self._server.start)


class SqsFifoHarness(SqsHarness):
    name = "sqs-fifo"
    dedups = True  # MessageDeduplicationId = event id
    suffix = ".fifo"


class WebhookHarness(BrokerHarness):
    """A local HTTP receiver of the test's own: an outage closes its port."""

    name = "webhook"
    options = "timeout=2"

    async def _open(self, cuttable: bool) -> None:
        self._server = WebhookServer()
        self._server.start()

    async def _close(self) -> None:
        await asyncio.to_thread(self._server.stop)

    async def destination(self) -> str:
        return "orders"  # the URL is the destination

    @property
    def url(self) -> str:
        return self._server.url()

    async def published(self, topic: str) -> int:
        return len(self._server.requests)

    async def received(self, topic: str, n: int, timeout: float = 20.0) -> list[ReceivedEvent]:
        from outboxkit.wire.webhook import decode

        deadline = time.monotonic() + timeout
        while len(self._server.requests) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return [
            from_envelope(topic, decode(r.body, r.headers)) for r in list(self._server.requests)
        ]

    async def cut(self) -> None:
        await asyncio.to_thread(self._server.stop)

    async def restore(self) -> None:
        await asyncio.to_thread(self._server.start)


#: Every broker once: the scenarios run over these.
BROKERS: dict[str, type[BrokerHarness]] = {
    h.name: h
    for h in (KafkaHarness, NatsHarness, RabbitMQHarness, RedisHarness, SqsHarness, WebhookHarness)
}
#: Variants whose duplicate handling differs (their own guarantee: no duplicate at all).
DEDUP_VARIANTS: dict[str, type[BrokerHarness]] = {
    h.name: h for h in (RedisDedupHarness, SqsFifoHarness)
}
