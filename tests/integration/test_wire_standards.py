"""What the relay puts on the wire, decoded by third-party implementations of the standards.

Events with hostile attribute values (``100%41``, ``München``, spaces, quotes, ``%``, emoji,
backslashes) are written through the outbox and relayed to real brokers; the official CloudEvents
SDK (``cloudevents``, its spec-following ``core.bindings``) decodes the Kafka records, the
HTTP requests and the AMQP messages, and every attribute must come back exactly. The NATS
binding uses the HTTP binding's header encoding (§3.1.3.2 of both); the SDK has no NATS
binding, so its HTTP decoder checks those headers. Signatures are checked with the
``standardwebhooks`` package and with the raw-bytes receiver of docs/brokers.md.

Each broker also carries the event's time the same way: CloudEvents ``time`` and the
broker's own timestamp are ``occurred_at`` (Kafka CreateTime, AMQP ``timestamp``).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import amqp as ce_amqp
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat
from standardwebhooks import Webhook, WebhookVerificationError

from outboxkit import Event
from outboxkit.consumers import kafka as kafka_consumer
from outboxkit.consumers import nats as nats_consumer
from outboxkit.consumers import rabbitmq as rabbitmq_consumer
from outboxkit.consumers.base import ReceivedEvent
from tests.support.relaying import count, running_relay, wait_for, write_events
from tests.support.servers import unique_name
from tests.support.webhook_server import WebhookServer

SECRET = "whsec_" + base64.b64encode(b"outboxkit wire-standards secret!").decode()
# A ce-* header value per §3.1.3.2: printable ASCII, and space, '"', '%' only as %XX.
ENCODED = re.compile(r"(?:[\x21\x23\x24\x26-\x7e]|%[0-9A-F]{2})*")
BROKERS_MD = Path(__file__).parents[2] / "docs" / "brokers.md"
# When the facts happened: an hour before they were written, at a +05:30 offset, with
# microseconds, so neither created_at nor the publish time can pass for it.
OCCURRED = dt.datetime.now(dt.timezone(dt.timedelta(hours=5, minutes=30))).replace(
    microsecond=123456
) - dt.timedelta(hours=1)
HOSTILE = [
    "100%41",
    "München",
    'a "quoted" value with spaces',
    "%",
    "%zz %C0%A0 100 %",
    "emoji 🚀😀 and € and 日本",
    "back\\slash, <angle> & ~tilde",
]


def hostile_events(topic: str) -> list[Event]:
    """One event per hostile value: it is every free-text attribute of that event."""
    return [
        Event(
            topic=topic,
            event_type=f"order.placed {value}",
            aggregate_type=f"Bücher & Co {i}",
            aggregate_id=value,
            key=f"{value} key",
            payload={"n": i, "value": value},
            schema_version=f"v{i} {value}",
            occurred_at=OCCURRED + dt.timedelta(seconds=i),
        )
        for i, value in enumerate(HOSTILE)
    ]


def assert_cloudevent(ce: BaseCloudEvent, event: Event) -> None:
    """Every attribute the SDK decoded, and the data, equal what the application wrote."""
    assert ce.get_specversion() == "1.0"
    assert ce.get_id() == str(event.event_id)
    assert ce.get_type() == event.event_type
    assert ce.get_source() == f"/outboxkit/{event.aggregate_type}"
    assert ce.get_subject() == event.aggregate_id
    assert ce.get_extension("partitionkey") == event.key
    assert ce.get_extension("schemaversion") == event.schema_version
    assert ce.get_time() == event.occurred_at
    expected_type = event.headers.get("content-type", "application/json")
    assert ce.get_datacontenttype() == expected_type
    assert ce.get_data() == json.loads(event.payload)


def assert_received(received: ReceivedEvent, event: Event) -> None:
    """What outboxkit's consumer runners decode: the same values, version and time included."""
    assert received.event_id == event.event_id
    assert received.event_type == event.event_type
    assert received.aggregate_type == event.aggregate_type
    assert received.aggregate_id == event.aggregate_id
    assert received.key == event.key
    assert received.schema_version == event.schema_version
    assert received.occurred_at == event.occurred_at
    assert received.payload == event.payload


async def relay_all(dsn: str, publisher: Any, events: list[Event]) -> None:
    write_events(dsn, events)
    async with running_relay(dsn, publisher):
        await wait_for(lambda: count(dsn) == 0, what="the relay to publish every event")


def epoch_ms(moment: dt.datetime) -> int:
    return (moment - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(milliseconds=1)


# -- Kafka: UTF-8 header values as they are; record timestamp = occurred_at ---------------


async def test_kafka_records_decode_exactly_in_the_cloudevents_sdk(
    db_dsn: str, kafka_broker: Any
) -> None:
    from confluent_kafka import TIMESTAMP_CREATE_TIME

    from outboxkit.publishers.kafka import KafkaPublisher
    from tests.support.servers import consume_kafka

    topic = unique_name("outboxkit-test-wire")
    events = hostile_events(topic)
    await relay_all(db_dsn, KafkaPublisher({"bootstrap.servers": kafka_broker.bootstrap}), events)
    records = await asyncio.to_thread(consume_kafka, kafka_broker.bootstrap, topic, len(events))
    by_id = {dict(r.headers() or [])["ce_id"].decode(): r for r in records}
    assert set(by_id) == {str(e.event_id) for e in events}
    for event in events:
        record = by_id[str(event.event_id)]
        headers = dict(record.headers() or [])
        # The Kafka binding carries UTF-8 as is: no percent-encoding to undo.
        assert headers["ce_subject"] == event.aggregate_id.encode()
        message = ce_kafka.KafkaMessage(headers=headers, key=record.key(), value=record.value())
        assert_cloudevent(ce_kafka.from_binary(message, JSONFormat()), event)
        # One meaning of "timestamp" on every broker: when the event occurred (CreateTime).
        assert record.timestamp() == (TIMESTAMP_CREATE_TIME, epoch_ms(event.occurred_at))
        received = kafka_consumer.decode(
            record.topic(), record.key(), record.value(), record.headers()
        )
        assert_received(received, event)


# -- HTTP webhooks: percent-encoded ce-* headers, Standard Webhooks signatures ------------


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    hooks = WebhookServer()
    hooks.start()
    yield hooks
    hooks.stop()


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OUTBOXKIT_TEST_WIRE_SECRET", SECRET)
    return "OUTBOXKIT_TEST_WIRE_SECRET"


async def test_webhook_requests_decode_exactly_in_the_cloudevents_sdk(
    db_dsn: str, server: WebhookServer, secret_env: str
) -> None:
    from outboxkit.publishers.webhook import WebhookPublisher

    events = hostile_events("orders")
    publisher = WebhookPublisher.from_url(f"{server.url()}?secret_env={secret_env}&timeout=5")
    await relay_all(db_dsn, publisher, events)
    by_id = {r.headers["webhook-id"]: r for r in server.requests}
    assert set(by_id) == {str(e.event_id) for e in events}
    for event in events:
        request = by_id[str(event.event_id)]
        # §3.1.3.2: only printable ASCII, and never a raw space, '"' or '%'.
        for name, value in request.headers.items():
            if name.startswith("ce-"):
                assert ENCODED.fullmatch(value), f"{name}: {value!r}"
        ce = ce_http.from_http(ce_http.HTTPMessage(request.headers, request.body), JSONFormat())
        assert_cloudevent(ce, event)
        Webhook(SECRET).verify(request.body, request.headers, json_parse=False)


def docs_receiver() -> dict[str, Any]:
    """The raw-bytes receiver of docs/brokers.md, run as the docs show it (minus the server)."""
    text = BROKERS_MD.read_text()
    match = re.search(r"```python\n(# receiver_raw\.py.*?)```", text, re.DOTALL)
    assert match, "docs/brokers.md lost its raw-bytes receiver (# receiver_raw.py)"
    namespace: dict[str, Any] = {"__name__": "receiver_raw"}
    code = compile(match.group(1), "docs/brokers.md#receiver_raw", "exec")
    exec(code, namespace)  # noqa: S102 -- the documented code of this repository, as shown
    return namespace


async def test_documented_raw_receiver_verifies_binary_and_json_deliveries(
    db_dsn: str, server: WebhookServer, secret_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outboxkit.publishers.webhook import WebhookPublisher

    binary = Event(topic="files", event_type="file.stored", payload=b"\xff\xfe\x00raw\x80")
    as_json = Event(topic="files", event_type="file.described", payload={"name": "München"})
    publisher = WebhookPublisher.from_url(f"{server.url()}?secret_env={secret_env}&timeout=5")
    await relay_all(db_dsn, publisher, [binary, as_json])
    by_id = {r.headers["webhook-id"]: r for r in server.requests}
    monkeypatch.setenv("ORDERS_HOOK_SECRET", SECRET)
    receiver = docs_receiver()
    key = receiver["secret_key"](SECRET)
    verify = receiver["verify"]
    for event in (binary, as_json):
        request = by_id[str(event.event_id)]
        assert request.body == event.payload
        verify(key, request.headers, request.body)  # raises if the signature does not match
        assert receiver["attribute"](request.headers, "type") == event.event_type
        # Forged body, wrong key, stale or missing timestamp: all refused.
        with pytest.raises(ValueError, match="signature"):
            verify(key, request.headers, request.body + b"!")
        with pytest.raises(ValueError, match="signature"):
            verify(b"another key", request.headers, request.body)
        stale = int(request.headers["webhook-timestamp"]) + receiver["TOLERANCE"] + 1
        with pytest.raises(ValueError, match="tolerance"):
            verify(key, request.headers, request.body, now=stale)
        with pytest.raises(ValueError, match="headers"):
            verify(key, {**request.headers, "webhook-timestamp": "soon"}, request.body)
    # The standardwebhooks package (1.3+, the dev extra's floor) verifies both deliveries on
    # the raw bytes, as the docs say; a tampered binary body is refused by it too.
    hook = Webhook(SECRET)
    hook.verify(by_id[str(as_json.event_id)].body, by_id[str(as_json.event_id)].headers)
    request = by_id[str(binary.event_id)]
    assert hook.verify(request.body, request.headers, json_parse=False) is None
    with pytest.raises(WebhookVerificationError):
        hook.verify(request.body + b"!", request.headers, json_parse=False)


# -- RabbitMQ (AMQP binding): UTF-8 application properties; timestamp = occurred_at -------


async def test_rabbitmq_messages_decode_exactly_in_the_cloudevents_amqp_binding(
    db_dsn: str,
) -> None:
    import aio_pika

    from outboxkit.publishers.rabbitmq import RabbitMQPublisher
    from tests.support.local_brokers import rabbitmq_url

    url = rabbitmq_url()
    exchange, queue_name = unique_name("outboxkit-test-wire"), unique_name("outboxkit-test-q")
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.declare_exchange(exchange, "topic", durable=True)
        queue = await channel.declare_queue(queue_name, durable=True)
        await queue.bind(exchange, "#")
        events = hostile_events("orders.wire")
        await relay_all(db_dsn, RabbitMQPublisher(url, exchange=exchange), events)
        messages: dict[str, Any] = {}
        deadline = time.monotonic() + 20
        while len(messages) < len(events) and time.monotonic() < deadline:
            message = await queue.get(no_ack=True, fail=False)
            if message is None:
                await asyncio.sleep(0.05)
                continue
            messages[str(message.message_id)] = message
        assert set(messages) == {str(e.event_id) for e in events}
        for event in events:
            message = messages[str(event.event_id)]
            headers = dict(message.headers or {})
            # The AMQP binding carries attribute strings as they are: no percent-encoding.
            assert headers["cloudEvents_subject"] == event.aggregate_id
            amqp = ce_amqp.AMQPMessage(
                properties={"content-type": message.content_type},
                application_properties=headers,
                application_data=message.body,
            )
            assert_cloudevent(ce_amqp.from_binary(amqp, JSONFormat()), event)
            # The AMQP timestamp property (whole seconds) is the occurred time too.
            stamp = message.timestamp
            stamp = stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)
            assert stamp == event.occurred_at.replace(microsecond=0)
            assert_received(rabbitmq_consumer.decode(message, "orders.wire"), event)
    finally:
        channel = await connection.channel()
        await channel.queue_delete(queue_name)
        await channel.exchange_delete(exchange)
        await connection.close()


# -- NATS: ce-* headers percent-encoded as in HTTP; decoded by the consumer runner --------


async def test_nats_headers_follow_the_binding_and_the_runner_decodes_them_exactly(
    db_dsn: str, nats_server: Any
) -> None:
    from outboxkit.publishers.nats import NatsPublisher
    from tests.support.servers import consume_nats, ensure_stream

    prefix = unique_name("wire").replace("-", "_")
    stream, subject = f"{prefix}_S", f"{prefix}.orders"
    await ensure_stream(nats_server.url, stream, [subject])
    events = hostile_events(subject)
    await relay_all(db_dsn, NatsPublisher([nats_server.url], stream=stream), events)
    messages = await consume_nats(nats_server.url, stream, subject, len(events))
    by_id = {m.headers["Nats-Msg-Id"]: m for m in messages}
    assert set(by_id) == {str(e.event_id) for e in events}
    for event in events:
        message = by_id[str(event.event_id)]
        ce_headers = {k: v for k, v in message.headers.items() if k.lower().startswith("ce-")}
        assert all(ENCODED.fullmatch(v) for v in ce_headers.values()), ce_headers
        assert ce_headers["ce-datacontenttype"] == "application/json"
        ce = ce_http.from_binary(ce_http.HTTPMessage(ce_headers, message.data), JSONFormat())
        assert_cloudevent(ce, event)
        assert_received(nats_consumer.decode(message.subject, message.data, message.headers), event)


async def test_nats_consumer_runner_hands_the_handler_version_and_occurred_time(
    db_dsn: str, nats_server: Any
) -> None:
    """End to end through the runner (not only its decode): the handler sees both fields."""
    from outboxkit.backends.postgres.migrate import migrate_inbox
    from outboxkit.consumers.nats import NatsConsumer
    from outboxkit.publishers.nats import NatsPublisher
    from tests.support.servers import ensure_stream

    migrate_inbox(db_dsn)
    prefix = unique_name("wire_run").replace("-", "_")
    stream, subject = f"{prefix}_S", f"{prefix}.orders"
    await ensure_stream(nats_server.url, stream, [subject])
    events = hostile_events(subject)
    seen: dict[uuid.UUID, ReceivedEvent] = {}

    async def handler(tx: Any, received: ReceivedEvent) -> None:
        seen[received.event_id] = received

    runner = NatsConsumer(
        db_dsn,
        handler,
        consumer="wire",
        servers=nats_server.url,
        stream=stream,
        subject=subject,
        fetch_timeout=0.2,
    )
    task = asyncio.create_task(runner.run())
    try:
        await relay_all(db_dsn, NatsPublisher([nats_server.url], stream=stream), events)
        await wait_for(lambda: len(seen) == len(events), what="the runner to apply every event")
    finally:
        runner.stop()
        await asyncio.wait_for(task, 30)
    for event in events:
        assert_received(seen[event.event_id], event)


# -- the stored time and version: an outbox from before schema version 2 -------------------


class _Recorder:
    """A publisher that keeps what the relay hands it (the claim's side, not a broker's)."""

    name = "recorder"

    def __init__(self) -> None:
        self.messages: list[Any] = []

    async def start(self) -> None:
        pass

    async def publish_batch(self, messages: Any) -> list[Any]:
        from outboxkit.publishers.base import PublishResult

        self.messages += messages
        return [PublishResult.success() for _ in messages]

    async def close(self) -> None:
        pass


async def test_a_version_1_outbox_upgrades_in_place_and_old_rows_send_their_created_at(
    empty_db_dsn: str,
) -> None:
    import psycopg

    from outboxkit import Outbox, Relay
    from outboxkit.backends.postgres.migrate import migrate
    from outboxkit.backends.postgres.postgres import SCHEMA_VERSION, Statements
    from outboxkit.errors import SchemaError

    stmts = Statements()
    old_id, old_created = uuid.uuid4(), dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        # An outbox as version 1 left it, with a row a version-1 writer put there.
        conn.execute(stmts.migrations[1])
        conn.execute(stmts.create_version_table)
        conn.execute(stmts.set_version, ("outbox", 1))
        conn.execute(
            "INSERT INTO outbox (event_id, topic, event_type, payload, created_at)"
            " VALUES (%s, 'orders', 'order.placed', '{}', %s)",
            (old_id, old_created),
        )
    # This release's writer and relay on the old table: outboxkit's error, with the command.
    with psycopg.connect(empty_db_dsn) as conn, pytest.raises(SchemaError, match="migrate"):
        Outbox().put(conn, Event(topic="orders", event_type="order.placed", payload={}))
    recorder = _Recorder()
    with pytest.raises(SchemaError, match="occurred_at.*outboxkit migrate"):
        await asyncio.wait_for(Relay(empty_db_dsn, recorder).run(), 30)  # stops at start
    assert recorder.messages == []
    migrate(empty_db_dsn)
    migrate(empty_db_dsn)  # idempotent: the second run finds everything in place
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT occurred_at, schema_version FROM outbox WHERE event_id = %s", (old_id,)
        ).fetchone()
        assert row == (None, None)  # no rewrite of existing rows
        version = conn.execute(stmts.get_version, ("outbox",)).fetchone()
        assert version == (SCHEMA_VERSION,)
    new = Event(
        topic="orders",
        event_type="order.placed",
        payload={},
        schema_version=2,
        occurred_at=OCCURRED,
    )
    recorder = _Recorder()
    await relay_all(empty_db_dsn, recorder, [new])
    by_id = {m.event_id: m for m in recorder.messages}
    assert by_id[old_id].occurred_at == old_created  # the claim falls back to created_at
    assert by_id[old_id].schema_version is None
    assert by_id[new.event_id].occurred_at == OCCURRED
    assert by_id[new.event_id].schema_version == "2"
    assert by_id[new.event_id].created_at > OCCURRED  # stored apart from the row's own time


def test_failed_show_includes_the_occurred_time_and_schema_version(db_dsn: str) -> None:
    from outboxkit.backends.postgres import admin

    event = hostile_events("orders")[1]
    write_events(db_dsn, [event])
    row = admin.get_event(db_dsn, str(event.event_id))
    assert row is not None
    assert (row["occurred_at"], row["schema_version"]) == (event.occurred_at, event.schema_version)
