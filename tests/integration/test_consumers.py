"""Consumer runners end to end: outbox → relay → real broker → runner → the consumer's table.

One scenario per broker, the same for all five: seven events are relayed, one of them twice
(a forced duplicate at the broker); a "flaky" event whose handler fails twice before it
succeeds must be redelivered and applied once; a "poison" event whose handler always fails
must end in the broker's dead-letter destination after `max_deliveries`, never in the table.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from outboxkit import Event, Outbox, Publisher
from outboxkit.backends.postgres.migrate import migrate_inbox
from outboxkit.consumers.base import ConsumerRunner, ReceivedEvent
from tests.support.relaying import count, running_relay, wait_for, write_events
from tests.support.servers import unique_name

MAX_DELIVERIES = 4
OCCURRED = dt.datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=dt.timezone(dt.timedelta(hours=-3)))
FAST = {"max_deliveries": MAX_DELIVERIES, "retry_delay": 0.05}
CREATE_LEDGER = """
CREATE TABLE ledger (
    id serial PRIMARY KEY, event_id uuid NOT NULL, n int, key text, tenant text,
    event_type text, aggregate_id text, topic text
)
"""


@dataclass
class Scenario:
    """The events of one test, the handler the runner calls, and what it saw."""

    dsn: str
    topic: str
    events: list[Event] = field(default_factory=list)
    attempts: collections.Counter[uuid.UUID] = field(default_factory=collections.Counter)
    delivery_counts: dict[uuid.UUID, list[int]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    # What the handler saw of each event's schema version and occurred time.
    envelopes: dict[uuid.UUID, tuple[str | None, dt.datetime | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def event(n: int, **extra: Any) -> Event:
            return Event(
                topic=self.topic,
                event_type="order.placed",
                payload={"n": n, **extra},
                key=f"customer-{n % 3}",
                aggregate_type="order",
                aggregate_id=str(n),
                headers={"tenant": "acme"},
                schema_version=2,
                occurred_at=OCCURRED + dt.timedelta(seconds=n),
            )

        self.events = [event(n) for n in range(5)]
        self.flaky = event(5, flaky=True)
        self.poison = event(6, poison=True)
        self.events += [self.flaky, self.poison]

    @property
    def good(self) -> list[Event]:
        return [e for e in self.events if e is not self.poison]

    async def handler(self, tx: psycopg.AsyncConnection[Any], event: ReceivedEvent) -> None:
        self.attempts[event.event_id] += 1
        self.envelopes[event.event_id] = (event.schema_version, event.occurred_at)
        self.delivery_counts[event.event_id].append(event.delivery_count)
        data = event.json()
        if data.get("poison"):
            raise RuntimeError("poison event: the handler always fails")
        if data.get("flaky") and self.attempts[event.event_id] <= 2:
            raise RuntimeError("flaky dependency down")
        await tx.execute(
            "INSERT INTO ledger (event_id, n, key, tenant, event_type, aggregate_id, topic)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (
                event.event_id,
                data["n"],
                event.key,
                event.headers.get("tenant"),
                event.event_type,
                event.aggregate_id,
                event.topic,
            ),
        )

    def ledger(self) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(
                "SELECT event_id, n, key, tenant, event_type, aggregate_id FROM ledger ORDER BY n"
            ).fetchall()

    def inbox_has(self, event_id: uuid.UUID) -> bool:
        return count(self.dsn, f"event_id = '{event_id}'", table="processed_events") > 0


@pytest.fixture
def scenario_dsn(db_dsn: str) -> str:
    migrate_inbox(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(CREATE_LEDGER)
    return db_dsn


async def run_scenario(
    s: Scenario,
    publisher: Publisher,
    runner: ConsumerRunner,
    *,
    dead_letters: Callable[[], Awaitable[list[str]]] | None,
    duplicate_in_outbox: bool = True,
    extra_duplicate: Callable[[], Awaitable[None]] | None = None,
    runner_dead_letters: bool = True,
) -> None:
    """Relay the events (one twice), run the runner until everything settled, check it all."""
    events = list(s.events)
    if duplicate_in_outbox:
        events.append(s.events[0])  # same event id in a second row: published twice
    write_events(s.dsn, events, outbox=Outbox(notify=True))
    task = asyncio.create_task(runner.run())
    try:
        async with running_relay(s.dsn, publisher):
            await wait_for(lambda: count(s.dsn) == 0, what="the relay to publish every event")
        if extra_duplicate is not None:
            await extra_duplicate()

        async def settled() -> bool:
            if task.done():
                task.result()  # surface a crashed runner at once
            return (
                len(s.ledger()) == len(s.good)
                and runner.stats.duplicates >= 1
                and (dead_letters is None or await _has(dead_letters, s.poison.event_id))
            )

        await wait_for(settled, timeout=40, interval=0.1, what=f"{runner.broker} to settle")
    finally:
        runner.stop()
        await asyncio.wait_for(task, 30)
    # every good event applied exactly once, with its key, headers and metadata
    assert [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in s.ledger()] == [
        (e.event_id, n, e.key, "acme", "order.placed", str(n)) for n, e in enumerate(s.good)
    ]
    assert runner.stats.applied == len(s.good)
    # the runner hands the handler the schema version and the time the event occurred
    assert [s.envelopes[e.event_id] for e in s.good] == [("2", e.occurred_at) for e in s.good]
    # the flaky event was redelivered after its failures and applied on the third delivery
    assert s.attempts[s.flaky.event_id] == 3
    # the poison event: never applied, no inbox record, delivered max_deliveries times
    assert not s.inbox_has(s.poison.event_id)
    if dead_letters is not None:
        assert s.attempts[s.poison.event_id] == MAX_DELIVERIES
        assert runner.stats.dead_lettered == (1 if runner_dead_letters else 0)


async def _has(dead_letters: Callable[[], Awaitable[list[str]]], event_id: uuid.UUID) -> bool:
    return str(event_id) in await dead_letters()


# -- Redis Streams ----------------------------------------------------------------------


async def test_redis_streams_runner_applies_once_retries_and_dead_letters(
    scenario_dsn: str,
) -> None:
    import redis.asyncio

    from outboxkit.consumers.redis import RedisStreamsConsumer
    from outboxkit.publishers.redis import RedisStreamsPublisher
    from tests.support.local_brokers import redis_url

    url = redis_url()
    stream = unique_name("outboxkit-test-consume")
    s = Scenario(scenario_dsn, stream)
    runner = RedisStreamsConsumer(
        scenario_dsn, s.handler, consumer="billing", url=url, streams=stream, block=0.1, **FAST
    )
    client = redis.asyncio.Redis.from_url(url)

    async def dead_letters() -> list[str]:
        entries = await client.xrange(f"{stream}:dead")
        return [fields[b"ce_id"].decode() for _, fields in entries]

    try:
        await run_scenario(s, RedisStreamsPublisher(url), runner, dead_letters=dead_letters)
        # nothing left pending in the group: every entry was acknowledged
        summary = await client.xpending(stream, "billing")
        assert summary["pending"] == 0
        assert s.delivery_counts[s.flaky.event_id] == [1, 2, 3]
    finally:
        await client.delete(stream, f"{stream}:dead")
        await client.aclose()


# -- NATS JetStream --------------------------------------------------------------------


async def test_nats_runner_applies_once_retries_and_dead_letters(
    scenario_dsn: str, nats_server: Any
) -> None:
    import nats

    from outboxkit.consumers.nats import NatsConsumer
    from outboxkit.publishers.nats import NatsPublisher
    from tests.support.servers import consume_nats, ensure_stream

    prefix = unique_name("consume").replace("-", "_")
    stream, dlq_stream = f"{prefix}_S", f"{prefix}_DLQ"
    subject = f"{prefix}.orders"
    await ensure_stream(nats_server.url, stream, [subject])
    await ensure_stream(nats_server.url, dlq_stream, [f"{prefix}.dlq"])
    s = Scenario(scenario_dsn, subject)
    runner = NatsConsumer(
        scenario_dsn,
        s.handler,
        consumer="billing",
        servers=nats_server.url,
        stream=stream,
        subject=subject,
        dead_letter_subject=f"{prefix}.dlq",
        fetch_timeout=0.2,
        **FAST,
    )

    async def republish_without_msg_id() -> None:
        # JetStream drops a re-publish with the same Nats-Msg-Id; force a duplicate past it.
        first = (await consume_nats(nats_server.url, stream, subject, 1))[0]
        headers = {k: v for k, v in first.headers.items() if k != "Nats-Msg-Id"}
        nc = await nats.connect(nats_server.url)
        try:
            await nc.jetstream().publish(subject, first.data, headers=headers)
        finally:
            await nc.close()

    async def dead_letters() -> list[str]:
        messages = await consume_nats(nats_server.url, dlq_stream, f"{prefix}.dlq", None)
        return [m.headers.get("ce-id", "") for m in messages]

    await run_scenario(
        s,
        NatsPublisher([nats_server.url], stream=stream),
        runner,
        dead_letters=dead_letters,
        duplicate_in_outbox=False,
        extra_duplicate=republish_without_msg_id,
    )
    assert s.delivery_counts[s.flaky.event_id] == [1, 2, 3]


# -- RabbitMQ ---------------------------------------------------------------------------


async def test_rabbitmq_runner_applies_once_retries_and_dead_letters(scenario_dsn: str) -> None:
    import aio_pika

    from outboxkit.consumers.rabbitmq import RabbitMQConsumer
    from outboxkit.publishers.rabbitmq import RabbitMQPublisher
    from tests.support.local_brokers import rabbitmq_url

    url = rabbitmq_url()
    exchange, dlx = unique_name("outboxkit-test-ex"), unique_name("outboxkit-test-dlx")
    queue_name, dlq_name = unique_name("outboxkit-test-q"), unique_name("outboxkit-test-dlq")
    connection = await aio_pika.connect(url)
    channel = await connection.channel()
    dead_exchange = await channel.declare_exchange(dlx, "fanout", durable=True)
    dlq = await channel.declare_queue(dlq_name, durable=True)
    await dlq.bind(dead_exchange)
    s = Scenario(scenario_dsn, "orders.placed")
    runner = RabbitMQConsumer(
        scenario_dsn,
        s.handler,
        consumer="billing",
        url=url,
        queue=queue_name,
        exchange=exchange,
        routing_keys=["orders.#"],
        dead_letter_exchange=dlx,
        **FAST,
    )
    seen: list[str] = []

    async def dead_letters() -> list[str]:
        while (message := await dlq.get(no_ack=True, fail=False)) is not None:
            seen.append(str(message.message_id))
        return seen

    try:
        # the runner declares and binds its queue first; the relay retries until then
        await run_scenario(
            s, RabbitMQPublisher(url, exchange=exchange), runner, dead_letters=dead_letters
        )
        declared = await channel.declare_queue(queue_name, passive=True)
        assert declared.declaration_result.message_count == 0
    finally:
        for name in (queue_name, dlq_name):
            await channel.queue_delete(name)
        for name in (exchange, dlx):
            await channel.exchange_delete(name)
        await connection.close()


# -- Amazon SQS (moto server) ---------------------------------------------------------


@pytest.fixture
def moto_sqs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from tests.support.moto_sqs import MotoSqs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    server = MotoSqs()
    server.start()
    yield server
    server.stop()


def _queue_with_dlq(moto_sqs: Any) -> tuple[str, str]:
    """The queue "orders", redriven to "orders-dlq" after MAX_DELIVERIES receives; both URLs."""
    import json

    dlq_url = moto_sqs.create_queue("orders-dlq")
    dlq_arn = moto_sqs.client().get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])[
        "Attributes"
    ]["QueueArn"]
    queue_url = moto_sqs.create_queue(
        "orders",
        RedrivePolicy=json.dumps(
            {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(MAX_DELIVERIES)}
        ),
        VisibilityTimeout="30",
    )
    return queue_url, dlq_url


async def test_sqs_runner_applies_once_retries_and_redrive_dead_letters(
    scenario_dsn: str, moto_sqs: Any
) -> None:

    from outboxkit.consumers.sqs import SqsConsumer
    from outboxkit.publishers.sqs import SqsPublisher

    _, dlq_url = _queue_with_dlq(moto_sqs)
    s = Scenario(scenario_dsn, "orders")
    runner = SqsConsumer(
        scenario_dsn,
        s.handler,
        consumer="billing",
        queue="orders",
        region="us-east-1",
        endpoint_url=moto_sqs.endpoint,
        wait_time=1,
        **FAST,
    )
    seen: list[str] = []

    async def dead_letters() -> list[str]:
        messages = await asyncio.to_thread(moto_sqs.drain, dlq_url, idle_polls=1)
        seen.extend(m["MessageAttributes"]["ce_id"]["StringValue"] for m in messages)
        return seen

    # SQS itself moves the poison message to the DLQ (redrive policy) on the receive after
    # maxReceiveCount; the runner only leaves it undeleted.
    await run_scenario(
        s,
        SqsPublisher("orders", region="us-east-1", endpoint_url=moto_sqs.endpoint),
        runner,
        dead_letters=dead_letters,
        runner_dead_letters=False,
    )
    assert s.delivery_counts[s.flaky.event_id] == [1, 2, 3]


async def test_sqs_runner_reads_sns_enveloped_messages_applies_once_and_redrive_dead_letters(
    scenario_dsn: str, moto_sqs: Any
) -> None:
    """SNS → SQS without raw delivery: the runner reads SNS's JSON notification."""
    import json

    from outboxkit.consumers.sqs import SqsConsumer
    from outboxkit.publishers.sns import SnsPublisher

    queue_url, dlq_url = _queue_with_dlq(moto_sqs)
    sns = moto_sqs.client("sns")
    topic_arn = sns.create_topic(Name="orders-topic")["TopicArn"]
    queue_arn = moto_sqs.client().get_queue_attributes(
        QueueUrl=queue_url, AttributeNames=["QueueArn"]
    )["Attributes"]["QueueArn"]
    sns.subscribe(TopicArn=topic_arn, Protocol="sqs", Endpoint=queue_arn)  # enveloped
    s = Scenario(scenario_dsn, "orders")
    runner = SqsConsumer(
        scenario_dsn,
        s.handler,
        consumer="billing",
        queue="orders",
        region="us-east-1",
        endpoint_url=moto_sqs.endpoint,
        wait_time=1,
        **FAST,
    )
    seen: list[str] = []

    async def dead_letters() -> list[str]:
        messages = await asyncio.to_thread(moto_sqs.drain, dlq_url, idle_polls=1)
        seen.extend(json.loads(m["Body"])["MessageAttributes"]["ce_id"]["Value"] for m in messages)
        return seen

    await run_scenario(
        s,
        SnsPublisher("orders-topic", region="us-east-1", endpoint_url=moto_sqs.endpoint),
        runner,
        dead_letters=dead_letters,
        runner_dead_letters=False,
    )
    assert s.delivery_counts[s.flaky.event_id] == [1, 2, 3]


async def test_kinesis_runner_applies_once_retries_in_place_and_skips_the_poison_event(
    scenario_dsn: str, moto_sqs: Any
) -> None:
    from outboxkit.consumers.kinesis import KinesisConsumer
    from outboxkit.publishers.kinesis import KinesisPublisher

    stream = unique_name("orders")
    moto_sqs.create_stream(stream, shards=2)
    s = Scenario(scenario_dsn, "orders")
    runner = KinesisConsumer(
        scenario_dsn,
        s.handler,
        consumer="billing",
        stream=stream,
        region="us-east-1",
        endpoint_url=moto_sqs.endpoint,
        poll_interval=0.1,
        **FAST,
    )

    async def dead_letters() -> list[str]:  # logged and skipped: Kinesis has no DLQ
        return [str(s.poison.event_id)] if runner.stats.dead_lettered else []

    await run_scenario(
        s,
        KinesisPublisher(stream, region="us-east-1", endpoint_url=moto_sqs.endpoint),
        runner,
        dead_letters=dead_letters,
    )
    assert s.delivery_counts[s.flaky.event_id] == [1, 2, 3]


# -- Kafka ------------------------------------------------------------------------------


async def test_kafka_runner_applies_once_retries_and_dead_letters(
    scenario_dsn: str, kafka_broker: Any
) -> None:
    from outboxkit.consumers.kafka import KafkaConsumer
    from outboxkit.publishers.kafka import KafkaPublisher
    from tests.support.servers import consume_kafka

    topic = unique_name("outboxkit-test-consume")
    s = Scenario(scenario_dsn, topic)
    runner = KafkaConsumer(
        scenario_dsn,
        s.handler,
        consumer="billing",
        bootstrap=kafka_broker.bootstrap,
        topics=topic,
        group=unique_name("billing"),
        dead_letter_topic=f"{topic}.dlq",
        poll_timeout=0.2,
        # The test broker (Tansu) holds a group join for about half the session timeout.
        config={
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
            "topic.metadata.refresh.interval.ms": 1000,
        },
        **FAST,
    )

    async def dead_letters() -> list[str]:
        messages = await asyncio.to_thread(
            consume_kafka, kafka_broker.bootstrap, f"{topic}.dlq", 1, 5.0
        )
        return [dict(m.headers() or [])["ce_id"].decode() for m in messages]

    await run_scenario(
        s,
        KafkaPublisher({"bootstrap.servers": kafka_broker.bootstrap}),
        runner,
        dead_letters=dead_letters,
    )
    assert s.delivery_counts[s.flaky.event_id] == [1, 2, 3]
