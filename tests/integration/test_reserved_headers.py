"""Header names a broker acts on, and rows written around ``Event()``, against real servers.

Issue 26, item 2: events with an application header ``Status: 404``/``408`` were stored by
NATS but never handled by the NATS consumer runner, and one with ``Status: 500`` made every
fetch raise, so the healthy events fetched with it were never handled either. Item 8: rows
written by plain SQL with a Unicode space in the topic or a forged ``CE-ID`` header were
published as they were. And RabbitMQ closes the channel over a string ``CC`` header, failing
every publish in flight on it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Iterator
from typing import Any

import nats
import psycopg
import pytest

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate_inbox
from outboxkit.consumers.base import ReceivedEvent
from outboxkit.consumers.nats import NatsConsumer
from outboxkit.errors import InvalidEventError
from outboxkit.publishers import from_url
from outboxkit.publishers.base import OutboundMessage
from outboxkit.wire.nats import encode_headers
from tests.integration.test_hostile_events import dead_letters, insert_raw
from tests.support.local_brokers import rabbitmq_url
from tests.support.moto_sqs import MotoSqs
from tests.support.relaying import count, running_relay, wait_for, write_events
from tests.support.servers import consume_kafka, consume_nats, ensure_stream, unique_name


def event(topic: str, n: int = 0, **fields: Any) -> Event:
    return Event(topic=topic, event_type="order.placed", payload={"n": n}, **fields)


def as_stored(e: Event, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The headers the NATS publisher sends for ``e``, plus ``extra`` as user headers."""
    message = OutboundMessage(
        e.event_id,
        e.topic,
        e.key,
        e.event_type,
        e.aggregate_type,
        e.aggregate_id,
        e.payload,
        {**(extra or {}), **e.headers},
        dt.datetime.now(dt.UTC),
    )
    return encode_headers(message)


# -- item 2: the NATS consumer runner and Status headers ---------------------------------------


async def test_the_nats_runner_handles_every_message_of_a_fetch_whatever_its_status_header(
    db_dsn: str, nats_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Stored messages carrying ``Status: 404``, ``408`` and ``500`` (published by an older
    outboxkit, or any client) among healthy ones, all in one fetch: every one is handled
    once, promptly; before, nats-py's fetch dropped the 404/408 ones and raised on the 500."""
    migrate_inbox(db_dsn)
    prefix = unique_name("status").replace("-", "_")
    stream, subject = f"{prefix}_S", f"{prefix}.orders"
    await ensure_stream(nats_server.url, stream, [subject])
    healthy = [event(subject, n) for n in range(5)]
    odd = {status: event(subject, 10 + i) for i, status in enumerate(("404", "408", "500"))}
    order = [healthy[0], odd["404"], healthy[1], odd["500"], healthy[2], odd["408"], *healthy[3:]]
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        for e in order:
            status = next((s for s, o in odd.items() if o is e), None)
            extra = {"Status": status, "Description": "stored"} if status else None
            await js.publish(subject, e.payload, headers=as_stored(e, extra))
    finally:
        await nc.close()

    handled: list[Any] = []
    seen_headers: dict[Any, dict[str, str]] = {}

    async def handler(tx: psycopg.AsyncConnection[Any], received: ReceivedEvent) -> None:
        handled.append(received.event_id)
        seen_headers[received.event_id] = received.headers

    runner = NatsConsumer(
        db_dsn,
        handler,
        consumer="billing",
        servers=nats_server.url,
        stream=stream,
        subject=subject,
        batch=10,
        fetch_timeout=0.5,
        retry_delay=0.05,
    )
    task = asyncio.create_task(runner.run())
    try:
        with caplog.at_level(logging.WARNING, logger="outboxkit"):
            await wait_for(
                lambda: len(handled) >= len(order) or task.done(),
                timeout=8,
                what="every stored message handled",
            )
    finally:
        runner.stop()
        await asyncio.wait_for(task, 30)
    assert sorted(map(str, handled)) == sorted(str(e.event_id) for e in order)
    assert runner.stats.applied == len(order) and runner.stats.failed == 0
    assert seen_headers[odd["500"].event_id]["Status"] == "500"  # the application's header
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_status_headed_message_the_runner_cannot_read_is_dead_lettered_readably(
    db_dsn: str, nats_server: Any
) -> None:
    """Not an outboxkit event (no id) and ``Status: 500``: dead-lettered in one line, the
    next message handled, and the copy's Status renamed so that nats-py's ``fetch()`` can
    read the dead-letter stream (with the header as it was, it raises there too)."""
    migrate_inbox(db_dsn)
    prefix = unique_name("status_dlq").replace("-", "_")
    stream, dlq_stream = f"{prefix}_S", f"{prefix}_DLQ"
    subject = f"{prefix}.orders"
    await ensure_stream(nats_server.url, stream, [subject])
    await ensure_stream(nats_server.url, dlq_stream, [f"{prefix}.dlq"])
    healthy = event(subject, 1)
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.publish(subject, b"{}", headers={"Status": "500", "Description": "x"})
        await js.publish(subject, healthy.payload, headers=as_stored(healthy))
    finally:
        await nc.close()
    handled: list[Any] = []

    async def handler(tx: psycopg.AsyncConnection[Any], received: ReceivedEvent) -> None:
        handled.append(received.event_id)

    runner = NatsConsumer(
        db_dsn,
        handler,
        consumer="billing",
        servers=nats_server.url,
        stream=stream,
        subject=subject,
        dead_letter_subject=f"{prefix}.dlq",
        fetch_timeout=0.5,
    )
    task = asyncio.create_task(runner.run())
    try:
        await wait_for(
            lambda: (handled and runner.stats.dead_lettered == 1) or task.done(),
            timeout=8,
            what="the healthy event handled and the other dead-lettered",
        )
    finally:
        runner.stop()
        await asyncio.wait_for(task, 30)
    assert handled == [healthy.event_id]
    [copy] = await consume_nats(nats_server.url, dlq_stream, f"{prefix}.dlq", None)
    assert copy.headers["outboxkit-original-Status"] == "500"
    assert "Status" not in copy.headers
    assert "carries no event id" in copy.headers["outboxkit-dead-letter-reason"]


# -- item 2: RabbitMQ's CC header closes the channel -------------------------------------------


async def test_a_cc_header_written_by_sql_is_dead_lettered_before_it_can_close_the_channel(
    db_dsn: str,
) -> None:
    """RabbitMQ answers a string ``CC`` header by closing the channel (PRECONDITION_FAILED
    unacceptable_type_in_header), which fails every publish in flight on it; an array one
    routes the message to more queues. Refused at ``Event()`` and at publish."""
    import aio_pika

    with pytest.raises(Exception, match="reserved by RabbitMQ"):
        event("orders", headers={"CC": "billing"})
    connection = await aio_pika.connect(rabbitmq_url(), timeout=10)
    channel = await connection.channel()
    queue = unique_name("orders")
    await channel.declare_queue(queue, durable=True)
    try:
        healthy = [event(queue, n) for n in range(20)]
        write_events(db_dsn, healthy[:10])
        hostile_id = insert_raw(db_dsn, queue, headers={"CC": "billing"})
        write_events(db_dsn, healthy[10:])
        url = f"{rabbitmq_url()}?exchange=&allow=orders_*"
        async with running_relay(db_dsn, from_url(url), max_attempts=5):
            await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
        dead = dead_letters(db_dsn)
        assert list(dead) == [str(hostile_id)]
        assert dead[str(hostile_id)]["attempts"] == 1
        assert "header 'CC' is reserved by RabbitMQ" in dead[str(hostile_id)]["last_error"]
        declared = await channel.declare_queue(queue, passive=True)
        assert declared.declaration_result.message_count == 20
    finally:
        await channel.queue_delete(queue)
        await connection.close()


# -- item 8: rows written around Event(), refused by Event()'s rules at publish ----------------


def test_a_lone_surrogate_fails_at_event_and_the_transaction_goes_on(db_dsn: str) -> None:
    """It used to pass ``Event()`` and fail at ``put`` with a ``UnicodeEncodeError`` from the
    driver, inside the caller's transaction."""
    outbox = Outbox()
    with psycopg.connect(db_dsn) as conn:
        with conn.transaction():
            for fields in ({"key": "k\ud800"}, {"headers": {"x-note": "\udfff"}}):
                with pytest.raises(InvalidEventError, match="lone surrogate"):
                    outbox.put(conn, event("orders", **fields))
            outbox.put(conn, event("orders"))
    assert count(db_dsn) == 1


@pytest.mark.parametrize(
    ("topic_suffix", "headers", "reason"),
    [
        ("orders\u00a0placed", {}, "topic contains whitespace"),
        ("orders\u3000", {}, "topic contains whitespace"),
        ("orders", {"CE-ID": "0190a0a0-0000-7000-8000-00000000beef"}, "'CE-ID' is reserved"),
        ("orders", {"ce-type": "refund.issued"}, "'ce-type' is reserved"),
        ("orders", {"Status": "500"}, "'Status' is reserved by NATS"),
    ],
)
async def test_nats_refuses_a_row_event_would_refuse(
    db_dsn: str, nats_server: Any, topic_suffix: str, headers: dict[str, str], reason: str
) -> None:
    prefix = unique_name("rules").replace("-", "_")
    stream = f"{prefix}_S"
    await ensure_stream(nats_server.url, stream, [f"{prefix}.>"])
    hostile_id = insert_raw(db_dsn, f"{prefix}.{topic_suffix}", headers=headers)
    honest = event(f"{prefix}.orders")
    write_events(db_dsn, [honest])
    async with running_relay(db_dsn, from_url(nats_server.url), max_attempts=5):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert list(dead) == [str(hostile_id)]
    assert dead[str(hostile_id)]["attempts"] == 1
    assert reason in dead[str(hostile_id)]["last_error"]
    assert "the rules of Event()" in dead[str(hostile_id)]["last_error"]
    stored = await consume_nats(nats_server.url, stream, f"{prefix}.>", None)
    assert [m.headers["Nats-Msg-Id"] for m in stored] == [str(honest.event_id)]


async def test_kafka_refuses_a_forged_ce_id_header_written_by_sql(
    db_dsn: str, kafka_broker: Any
) -> None:
    """On Kafka a ``ce_id`` user header travelled beside the real one: a consumer reading the
    first (or last) ``ce_id`` deduplicated on the forged id."""
    topic = unique_name("orders")
    honest = event(topic)
    forged = insert_raw(db_dsn, topic, headers={"ce_id": str(honest.event_id)})
    write_events(db_dsn, [honest])
    async with running_relay(db_dsn, from_url(kafka_broker.url), max_attempts=5):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert list(dead) == [str(forged)]
    assert "'ce_id' is reserved by outboxkit" in dead[str(forged)]["last_error"]
    records = consume_kafka(kafka_broker.bootstrap, topic, 1)
    assert [dict(r.headers() or [])["ce_id"].decode() for r in records] == [str(honest.event_id)]


@pytest.fixture
def moto_sqs(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoSqs]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    server = MotoSqs()
    server.start()
    yield server
    server.stop()


async def test_sqs_refuses_a_header_that_would_forge_the_schema_version(
    db_dsn: str, moto_sqs: MotoSqs
) -> None:
    """SQS carries user headers in one JSON attribute, and a reader takes ``ce_schemaversion``
    from there when the attributes ran out: a forged one became the event's schema version."""
    queue = unique_name("orders")
    queue_url = moto_sqs.create_queue(queue)
    honest = event(queue)
    forged = insert_raw(db_dsn, queue, headers={"ce_schemaversion": "99"})
    write_events(db_dsn, [honest])
    async with running_relay(db_dsn, from_url(moto_sqs.url(queue)), max_attempts=5):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert list(dead) == [str(forged)]
    assert "'ce_schemaversion' is reserved by outboxkit" in dead[str(forged)]["last_error"]
    messages = await asyncio.to_thread(moto_sqs.drain, queue_url)
    ids = [m["MessageAttributes"]["ce_id"]["StringValue"] for m in messages]
    assert ids == [str(honest.event_id)]
