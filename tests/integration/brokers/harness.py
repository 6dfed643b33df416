"""One small harness per broker, so each delivery guarantee is written once for all of them.

A harness knows four things about its broker: the URL a relay publishes to, how to make a
fresh destination, how to read back what arrived (decoded by the consumer side's own
decoder, so the wire format is checked both ways), and how to cut and restore the link.
The scenarios in this package use nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import re
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import orjson
import pytest

from outboxkit import Event
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

    async def received(self, topic: str, n: int, timeout: float = 20.0) -> list[ReceivedEvent]:
        """Everything that arrived on ``topic`` (at least ``n``, unless time ran out), decoded."""
        return [self.decode(topic, raw) for raw in await self.fetch(topic, n, timeout)]

    @abstractmethod
    async def fetch(self, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
        """Everything that arrived on ``topic`` (at least ``n``, unless time ran out), as the
        broker's client returns it."""

    @abstractmethod
    def decode(self, topic: str, raw: Any) -> ReceivedEvent:
        """One fetched message, read by the consumer side's own decoder."""

    #: The broker keeps the relay's order for one relay and one destination (entries in
    #: outbox order): the scenario checks it.
    ordered: ClassVar[bool] = False

    def check_binding(self, event: Event, raw: Any) -> None:  # noqa: B027 - optional
        """Assert what this broker's binding adds to the envelope (properties, native ids)."""

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

    async def fetch(self, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
        bootstrap = self._broker.bootstrap
        got = await asyncio.to_thread(consume_kafka, bootstrap, topic, n, timeout)
        # Then everything for a moment: duplicates beyond `n` must be seen too.
        everything = await asyncio.to_thread(consume_kafka, bootstrap, topic, 10**6, 2.0)
        return everything if len(everything) >= len(got) else got

    def decode(self, topic: str, raw: Any) -> ReceivedEvent:
        from outboxkit.consumers.kafka import decode

        return decode(raw.topic(), raw.key(), raw.value(), raw.headers())

    def check_binding(self, event: Event, raw: Any) -> None:
        """Key = event key; CloudEvents as ``ce_*`` headers; CreateTime = occurred_at."""
        assert raw.key() == (event.key.encode() if event.key is not None else None)
        headers = dict(raw.headers())
        event_id = str(event.event_id).encode()
        assert headers["idempotency-key"] == headers["ce_id"] == event_id
        assert headers["ce_specversion"] == b"1.0"
        assert headers["content-type"] == _content_type(event).encode()
        assert raw.timestamp()[1] == (event.occurred_at - _EPOCH) // dt.timedelta(milliseconds=1)

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

    async def fetch(self, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
        stream = self._streams[topic]
        got = await consume_nats(self._server_url, stream, topic, n, timeout)
        # Then everything the stream stores (read once the relays stopped): duplicates
        # beyond `n` must be seen too.
        everything = await consume_nats(self._server_url, stream, topic, None)
        return everything if len(everything) >= len(got) else got

    def decode(self, topic: str, raw: Any) -> ReceivedEvent:
        from outboxkit.consumers.nats import decode

        return decode(raw.subject, raw.data, raw.headers)

    def check_binding(self, event: Event, raw: Any) -> None:
        """``Nats-Msg-Id`` = event id (JetStream's dedup key); ``ce-*`` headers."""
        assert raw.subject == event.topic
        assert raw.headers["Nats-Msg-Id"] == raw.headers["ce-id"] == str(event.event_id)
        assert raw.headers["ce-specversion"] == "1.0"
        assert raw.headers["content-type"] == _content_type(event)

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

    async def fetch(self, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
        queue = self._queues[topic]
        deadline = time.monotonic() + timeout
        got: list[Any] = []
        while time.monotonic() < deadline:
            message = await queue.get(no_ack=True, fail=False)
            if message is not None:
                got.append(message)
            elif len(got) >= n:
                break
            else:
                await asyncio.sleep(0.05)
        return got

    def decode(self, topic: str, raw: Any) -> ReceivedEvent:
        from outboxkit.consumers.rabbitmq import decode

        return decode(raw, raw.routing_key or topic)

    def check_binding(self, event: Event, raw: Any) -> None:
        """AMQP properties (id, type, persistence, time, app) and ``cloudEvents_*`` headers."""
        import aio_pika

        event_id = str(event.event_id)
        assert raw.message_id == event_id
        assert raw.routing_key == event.topic
        assert raw.type == event.event_type
        assert raw.app_id == "outboxkit"
        assert raw.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert raw.timestamp is not None
        assert raw.content_type == _content_type(event)
        headers = raw.headers
        assert headers["idempotency-key"] == headers["cloudEvents_id"] == event_id
        assert headers["cloudEvents_type"] == event.event_type
        assert headers["cloudEvents_specversion"] == "1.0"
        assert headers["cloudEvents_source"] == _source(event)
        assert "cloudEvents_datacontenttype" not in headers, "the content_type property"
        assert ("cloudEvents_subject" in headers) == (event.aggregate_id is not None)

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

    ordered = True  # one pipeline per batch, in outbox order

    async def fetch(self, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while await self.published(topic) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return [fields for _id, fields in await self._client.xrange(topic)]

    def decode(self, topic: str, raw: Any) -> ReceivedEvent:
        from outboxkit.consumers.redis import decode

        return decode(topic, raw)

    def check_binding(self, event: Event, raw: Any) -> None:
        """Fields ``data`` (the bytes), ``ce_<attr>``, and ``headers`` only when there are any."""
        assert raw[b"data"] == event.payload
        assert raw[b"ce_id"] == str(event.event_id).encode()
        assert raw[b"ce_type"] == event.event_type.encode()
        assert raw[b"ce_specversion"] == b"1.0"
        assert raw[b"ce_time"]
        assert raw[b"ce_datacontenttype"] == _content_type(event).encode()
        assert raw[b"ce_source"] == _source(event).encode()
        user = {k: v for k, v in event.headers.items() if k != "content-type"}
        if user:
            assert orjson.loads(raw[b"headers"]) == user
        else:
            assert b"headers" not in raw, "no user headers, no field"
        assert (b"ce_partitionkey" in raw) == (event.key is not None)

    async def cut(self) -> None:
        self._server.kill()

    async def restore(self) -> None:
        self._server.start()


class RedisDedupHarness(RedisHarness):
    name = "redis-dedup"
    dedups = True  # the dedup script's SET NX per event id
    query = "dedup_window=300"


class MotoHarness(BrokerHarness):
    """moto's AWS server of the test's own: an outage stops it, its queues and streams survive.

    The destination is in the URL; the event's topic only labels it.
    """

    options = "timeout=2"

    async def _open(self, cuttable: bool) -> None:
        monkeypatch = self.request.getfixturevalue("monkeypatch")
        # Dummy credentials through the normal boto3 chain; relay processes inherit them.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        self._server = MotoSqs()
        await asyncio.to_thread(self._server.start)
        await asyncio.to_thread(self._create)

    @abstractmethod
    def _create(self) -> None:
        """Create the destination on the started server."""

    @abstractmethod
    def _read_all(self) -> list[Any]:
        """Everything the destination holds (an SQS queue is drained by it)."""

    async def _close(self) -> None:
        await asyncio.to_thread(self._server.stop)

    async def destination(self) -> str:
        return "orders"

    async def fetch(self, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while await self.published(topic) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return list(await asyncio.to_thread(self._read_all))

    async def cut(self) -> None:
        await asyncio.to_thread(self._server.stop)

    async def restore(self) -> None:
        await asyncio.to_thread(self._server.start)


class SqsHarness(MotoHarness):
    """moto's SQS server of the test's own: an outage stops it, its queues survive."""

    name = "sqs"
    default_limit = "MaximumMessageSize"
    small_limit = ("max_message_bytes=4096", "max_message_bytes")
    suffix = ""

    def _create(self) -> None:
        self._queue = unique_name("orders") + self.suffix
        self._queue_url = self._server.create_queue(self._queue)

    def _read_all(self) -> list[Any]:
        return self._server.drain(self._queue_url)

    @property
    def url(self) -> str:
        return self._server.url(self._queue)

    async def published(self, topic: str) -> int:
        return await asyncio.to_thread(self._server.depth, self._queue_url)

    def decode(self, topic: str, raw: Any) -> ReceivedEvent:
        from outboxkit.consumers.sqs import decode

        return decode(self._queue, raw)

    def check_binding(self, event: Event, raw: Any) -> None:
        """At most 10 String attributes; a body SQS cannot carry as text is base64."""
        attrs = {k: v["StringValue"] for k, v in raw["MessageAttributes"].items()}
        assert len(attrs) <= 10, "SQS allows at most 10 message attributes"
        assert attrs["ce_id"] == str(event.event_id)
        assert attrs["ce_type"] == event.event_type
        assert attrs["ce_specversion"] == "1.0"
        assert attrs["ce_time"]
        assert attrs["content-type"] == _content_type(event)
        if _sqs_text(event.payload):
            assert "content-transfer-encoding" not in attrs
            assert raw["Body"].encode() == event.payload
        else:  # not UTF-8, or characters SQS refuses in a body
            assert attrs["content-transfer-encoding"] == "base64"
            assert base64.b64decode(raw["Body"]) == event.payload


class SqsFifoHarness(SqsHarness):
    name = "sqs-fifo"
    dedups = True  # MessageDeduplicationId = event id
    suffix = ".fifo"


class SnsHarness(SqsHarness):
    """An SNS topic of moto's server with an SQS queue subscribed, read by the SQS runner's
    decoder: raw message delivery (the SQS binding as it is) or SNS's JSON envelope."""

    name = "sns"
    default_limit = "SNS's message size limit"
    raw = True

    def _create(self) -> None:
        super()._create()
        self._topic = unique_name("orders-topic") + self.suffix
        sns = self._server.client("sns")
        attributes = {"FifoTopic": "true"} if self.suffix else {}
        arn = sns.create_topic(Name=self._topic, Attributes=attributes)["TopicArn"]
        queue_arn = self._server.client().get_queue_attributes(
            QueueUrl=self._queue_url, AttributeNames=["QueueArn"]
        )["Attributes"]["QueueArn"]
        sns.subscribe(
            TopicArn=arn,
            Protocol="sqs",
            Endpoint=queue_arn,
            Attributes={"RawMessageDelivery": "true" if self.raw else "false"},
        )

    @property
    def url(self) -> str:
        return self._server.url(self._topic).replace("sqs://", "sns://", 1)

    def check_binding(self, event: Event, raw: Any) -> None:
        """Raw delivery: the SQS binding as it is; enveloped: the same inside SNS's JSON."""
        if self.raw:
            super().check_binding(event, raw)
            return
        assert "ce_id" not in (raw.get("MessageAttributes") or {})
        document = orjson.loads(raw["Body"])
        assert document["Type"] == "Notification"
        assert document["TopicArn"].endswith(":" + self._topic)
        attrs = {k: v["Value"] for k, v in document["MessageAttributes"].items()}
        assert len(attrs) <= 10
        assert attrs["ce_id"] == str(event.event_id)
        assert attrs["content-type"] == _content_type(event)


class SnsEnvelopeHarness(SnsHarness):
    name = "sns-envelope"
    raw = False


class SnsFifoHarness(SnsHarness):
    name = "sns-fifo"
    dedups = True  # MessageDeduplicationId = event id
    suffix = ".fifo"

    def check_binding(self, event: Event, raw: Any) -> None:
        """FIFO: the group is the event key (its topic without one); the dedup id its id."""
        super().check_binding(event, raw)
        attributes = raw["Attributes"]
        assert attributes["MessageDeduplicationId"] == str(event.event_id)
        group = event.key if event.key is not None else event.topic
        if group.isascii() and " " not in group:
            assert attributes["MessageGroupId"] == group
        else:  # not a valid MessageGroupId: its digest, the same for every event of the key
            assert attributes["MessageGroupId"].startswith("sha256:")


class EventBridgeHarness(SqsHarness):
    """A bus of moto's server with a rule whose target is an SQS queue, read by the SQS
    runner's decoder (which unwraps EventBridge's event)."""

    name = "eventbridge"
    default_limit = "EventBridge's entry size limit"

    def _create(self) -> None:
        super()._create()
        self._bus = unique_name("orders-bus")
        events = self._server.client("events")
        events.create_event_bus(Name=self._bus)
        rule = "to-queue"
        events.put_rule(
            Name=rule,
            EventBusName=self._bus,
            EventPattern=orjson.dumps({"detail": {"specversion": ["1.0"]}}).decode(),
        )
        queue_arn = self._server.client().get_queue_attributes(
            QueueUrl=self._queue_url, AttributeNames=["QueueArn"]
        )["Attributes"]["QueueArn"]
        events.put_targets(
            Rule=rule, EventBusName=self._bus, Targets=[{"Id": "queue", "Arn": queue_arn}]
        )

    @property
    def url(self) -> str:
        return self._server.url(self._bus).replace("sqs://", "eventbridge://", 1)

    def check_binding(self, event: Event, raw: Any) -> None:
        """Source, detail-type and time from the event; the detail is the CloudEvent."""
        document = orjson.loads(raw["Body"])
        assert document["source"] == _source(event)
        assert document["detail-type"] == event.event_type
        detail = document["detail"]
        assert detail["id"] == str(event.event_id), "the event id in the detail"
        assert detail["specversion"] == "1.0"
        assert detail["type"] == event.event_type
        assert detail["datacontenttype"] == _content_type(event)
        if "data" in detail:
            assert detail["data"] == orjson.loads(event.payload)
        else:  # not JSON: wrapped
            assert base64.b64decode(detail["data_base64"]) == event.payload


class KinesisHarness(MotoHarness):
    """A two-shard stream of moto's server of the test's own: an outage stops the server."""

    name = "kinesis"
    default_limit = "Kinesis's record size limit"
    small_limit = ("max_message_bytes=4096", "max_message_bytes")

    def _create(self) -> None:
        self._stream = unique_name("orders-stream")
        self._server.create_stream(self._stream)

    def _read_all(self) -> list[Any]:
        return self._server.read_stream(self._stream)

    @property
    def url(self) -> str:
        return self._server.url(self._stream).replace("sqs://", "kinesis://", 1)

    async def published(self, topic: str) -> int:
        return len(await asyncio.to_thread(self._server.read_stream, self._stream))

    def decode(self, topic: str, raw: Any) -> ReceivedEvent:
        from outboxkit.consumers.kinesis import decode

        return decode(self._stream, raw)

    def check_binding(self, event: Event, raw: Any) -> None:
        """Partition key = event key (the id without one); the data is CloudEvents JSON."""
        assert raw["PartitionKey"] == (event.key if event.key is not None else str(event.event_id))
        document = orjson.loads(raw["Data"])
        assert document["id"] == str(event.event_id)
        assert document["specversion"] == "1.0"
        assert document["type"] == event.event_type
        assert document["source"] == _source(event)
        assert document["datacontenttype"] == _content_type(event)
        if "data" in document:
            assert orjson.loads(event.payload) == document["data"]
        else:
            assert base64.b64decode(document["data_base64"]) == event.payload


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

    async def fetch(self, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while len(self._server.requests) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return list(self._server.requests)

    def decode(self, topic: str, raw: Any) -> ReceivedEvent:
        from outboxkit.wire.webhook import decode

        return from_envelope(topic, decode(raw.body, raw.headers))

    def check_binding(self, event: Event, raw: Any) -> None:
        """The body as it is, ``ce-*`` headers, the event id as webhook-id and idempotency key."""
        event_id = str(event.event_id)
        assert raw.body == event.payload
        assert raw.headers["webhook-id"] == raw.headers["idempotency-key"] == event_id
        assert raw.headers["ce-id"] == event_id
        assert raw.headers["ce-specversion"] == "1.0"
        assert raw.headers["ce-time"]
        assert raw.headers["content-type"] == _content_type(event)

    async def cut(self) -> None:
        await asyncio.to_thread(self._server.stop)

    async def restore(self) -> None:
        await asyncio.to_thread(self._server.start)


class MemoryHarness(BrokerHarness):
    """The testing kit's ``memory://`` broker (Kafka binding): in-process relays only."""

    name = "memory"

    async def _open(self, cuttable: bool) -> None:
        from outboxkit.publishers.memory import MemoryBroker

        self._broker = MemoryBroker.named(f"contract-{uuid.uuid4().hex[:8]}")

    async def _close(self) -> None:
        from outboxkit.publishers.memory import MemoryBroker

        MemoryBroker.forget(self._broker.name)

    async def destination(self) -> str:
        return f"contract-{uuid.uuid4().hex[:8]}"

    @property
    def url(self) -> str:
        return f"memory://{self._broker.name}"

    async def published(self, topic: str) -> int:
        return len(self._broker.on(topic))

    async def fetch(self, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
        return self._broker.on(topic)

    def decode(self, topic: str, raw: Any) -> ReceivedEvent:
        return from_envelope(raw.topic, raw.envelope())

    def check_binding(self, event: Event, raw: Any) -> None:
        """What the Kafka binding puts in the record: the key, ``ce_*`` headers, the id."""
        assert raw.key == event.key
        assert raw.headers["idempotency-key"] == raw.headers["ce_id"] == str(event.event_id)
        assert raw.headers["ce_specversion"] == "1.0"
        assert raw.headers["content-type"] == _content_type(event)

    async def cut(self) -> None:
        self._broker.cut()

    async def restore(self) -> None:
        self._broker.restore()


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _content_type(event: Event) -> str:
    return event.headers.get("content-type", "application/json")


def _source(event: Event) -> str:
    return f"/outboxkit/{event.aggregate_type}" if event.aggregate_type else "/outboxkit"


# What an SQS body may hold as text (its allowed Unicode ranges).
_SQS_TEXT = re.compile("[\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*")


def _sqs_text(payload: bytes) -> bool:
    try:
        return _SQS_TEXT.fullmatch(payload.decode("utf-8")) is not None
    except UnicodeDecodeError:
        return False


#: Every broker once: the scenarios run over these.
BROKERS: dict[str, type[BrokerHarness]] = {
    h.name: h
    for h in (
        KafkaHarness,
        NatsHarness,
        RabbitMQHarness,
        RedisHarness,
        SqsHarness,
        SnsHarness,
        SnsEnvelopeHarness,
        KinesisHarness,
        EventBridgeHarness,
        WebhookHarness,
    )
}
#: Brokers inside the test process: the scenarios whose relay runs in-process run on them too.
IN_PROCESS: dict[str, type[BrokerHarness]] = {h.name: h for h in (MemoryHarness,)}
#: Variants whose duplicate handling differs (their own guarantee: no duplicate at all).
DEDUP_VARIANTS: dict[str, type[BrokerHarness]] = {
    h.name: h for h in (RedisDedupHarness, SqsFifoHarness, SnsFifoHarness)
}
