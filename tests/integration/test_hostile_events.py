"""Hostile events against real servers: what a topic, a key or a header can make a broker do.

Each test replays an attack of issue 12 through the real relay: a CR LF in a NATS subject or
header (protocol injection, a forged ``Nats-Msg-Id`` that made JetStream drop a later event),
a ``Nats-Rollup`` header that purged a subject, a topic naming another application's Redis
stream or RabbitMQ queue, a 50 MB key written by plain SQL. ``Event()`` refuses such fields;
rows written around it (plain SQL, an older outboxkit) are inserted here with SQL, and the
relay must dead-letter them with the reason, publish nothing of them and lose nothing else.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aio_pika
import nats
import orjson
import psycopg
import pytest
import redis.asyncio
from nats.js.api import StreamConfig

from outboxkit import Event, Outbox
from outboxkit.errors import InvalidEventError
from outboxkit.publishers.base import OutboundMessage, Publisher, PublishResult
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.publishers.rabbitmq import RabbitMQPublisher
from outboxkit.publishers.redis import DEDUP_KEY_PREFIX, RedisStreamsPublisher
from tests.support.local_brokers import rabbitmq_url, redis_url
from tests.support.relaying import count, rows, running_relay, wait_for, write_events
from tests.support.servers import consume_nats, unique_name


def insert_raw(
    dsn: str,
    topic: str,
    *,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    key_sql: str | None = None,
    headers_sql: str | None = None,
) -> uuid.UUID:
    """A row as plain SQL or an older outboxkit writes it: no ``Event()`` checks on the way."""
    event_id = uuid.uuid4()
    key_expr = key_sql or "%(key)s"
    headers_expr = headers_sql or "%(headers)s::jsonb"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (event_id, topic, key, event_type, payload, headers)"
            f" VALUES (%(id)s, %(topic)s, {key_expr}, 'order.placed', '\\x7b7d', {headers_expr})",
            {
                "id": event_id,
                "topic": topic,
                "key": key,
                "headers": orjson.dumps(headers or {}).decode(),
            },
        )
    return event_id


def dead_letters(dsn: str) -> dict[str, dict[str, Any]]:
    return {str(r["event_id"]): r for r in rows(dsn, "status = 2")}


def event(topic: str, **fields: Any) -> Event:
    return Event(topic=topic, event_type="order.placed", payload={"n": 1}, **fields)


# -- NATS --------------------------------------------------------------------------------


@pytest.fixture
async def stream(nats_server: Any) -> AsyncIterator[tuple[str, str]]:
    """A JetStream stream of this test over ``<root>.>`` (rollups allowed), deleted after."""
    root = unique_name("hostile").replace("-", "_")
    name = root.upper()
    nc = await nats.connect(nats_server.url, connect_timeout=5, allow_reconnect=False)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=name, subjects=[f"{root}.>"], allow_rollup_hdrs=True))
    try:
        yield root, name
    finally:
        await js.delete_stream(name)
        await nc.close()


async def stored(url: str, stream_name: str, subject: str) -> list[Any]:
    """Every message of `subject` the stream stores, all read (the relays have stopped)."""
    return await consume_nats(url, stream_name, subject, None)


async def test_a_crlf_topic_cannot_publish_onto_another_subject(
    db_dsn: str, nats_server: Any, stream: tuple[str, str]
) -> None:
    root, name = stream
    hostile = f"{root}.orders 0\r\n\r\nPUB {root}.billing.refund 9\r\nrefund:1"
    with pytest.raises(InvalidEventError, match="control character"):
        event(hostile)
    hostile_id = insert_raw(db_dsn, hostile)
    honest = event(f"{root}.orders")
    write_events(db_dsn, [honest])
    async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url)):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert list(dead) == [str(hostile_id)]
    assert "whitespace or a control character" in dead[str(hostile_id)]["last_error"]
    assert dead[str(hostile_id)]["attempts"] == 1  # at once, not after max_attempts
    assert await stored(nats_server.url, name, f"{root}.billing.>") == []
    messages = await stored(nats_server.url, name, f"{root}.>")
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [str(honest.event_id)]


async def test_a_header_value_cannot_forge_the_dedup_id_of_a_later_event(
    db_dsn: str, nats_server: Any, stream: tuple[str, str]
) -> None:
    """The attack: a value ``1\\r\\nNats-Msg-Id: <B>`` made JetStream store the hostile event
    under B's id, drop B as a duplicate, and the relay deleted B's row: B was lost."""
    root, name = stream
    later = event(f"{root}.orders")
    forged = {"x-note": f"1\r\nNats-Msg-Id: {later.event_id}"}
    with pytest.raises(InvalidEventError, match="control character"):
        event(f"{root}.orders", headers=forged)
    hostile_id = insert_raw(db_dsn, f"{root}.orders", headers=forged)
    write_events(db_dsn, [later])
    async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url)):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert list(dead) == [str(hostile_id)]
    assert "contains a control character" in dead[str(hostile_id)]["last_error"]
    messages = await stored(nats_server.url, name, f"{root}.>")
    assert len(messages) == 1
    assert messages[0].headers["Nats-Msg-Id"] == str(later.event_id)
    assert messages[0].headers["ce-id"] == str(later.event_id)
    assert "x-note" not in messages[0].headers  # the hostile event itself never went out


async def test_a_nats_header_cannot_purge_a_subject(
    db_dsn: str, nats_server: Any, stream: tuple[str, str]
) -> None:
    """The attack: ``Nats-Rollup: sub`` (which nats-py 2.16 still sends) purged every earlier
    message of the subject. It is refused at construction and dead-lettered by the relay."""
    root, name = stream
    subject = f"{root}.ledger"
    earlier = [event(subject, key=f"k{i}") for i in range(3)]
    write_events(db_dsn, earlier)
    async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url)):
        await wait_for(lambda: count(db_dsn) == 0, what="earlier events published")
    with pytest.raises(InvalidEventError, match="is reserved"):
        event(subject, headers={"Nats-Rollup": "sub"})
    rollup_id = insert_raw(db_dsn, subject, headers={"Nats-Rollup": "sub"})
    expected_id = insert_raw(db_dsn, subject, headers={"nats-expected-last-sequence": "1"})
    async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url)):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert set(dead) == {str(rollup_id), str(expected_id)}
    assert "reserved by NATS" in dead[str(rollup_id)]["last_error"]
    messages = await stored(nats_server.url, name, subject)
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [str(e.event_id) for e in earlier]


@pytest.mark.parametrize("suffix", ["*", ">", "orders..placed", "orders."])
async def test_a_wildcard_or_malformed_subject_is_dead_lettered_at_once(
    db_dsn: str, nats_server: Any, stream: tuple[str, str], suffix: str
) -> None:
    root, _ = stream
    hostile_id = insert_raw(db_dsn, f"{root}.{suffix}")
    async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url), max_attempts=5):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert list(dead) == [str(hostile_id)]
    assert dead[str(hostile_id)]["attempts"] == 1
    assert "nats: subject" in dead[str(hostile_id)]["last_error"]


# -- bounds the relay keeps -----------------------------------------------------------------


class Recording:
    """A real publisher, and the largest key and header set it was handed."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.name = inner.name
        self.largest_key = 0
        self.largest_headers = 0

    async def start(self) -> None:
        await self.inner.start()

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        for m in messages:
            self.largest_key = max(self.largest_key, len(m.key or ""))
            self.largest_headers = max(
                self.largest_headers, sum(len(k) + len(v) for k, v in m.headers.items())
            )
        return await self.inner.publish_batch(messages)

    async def close(self) -> None:
        await self.inner.close()


async def test_a_fifty_megabyte_key_written_by_sql_is_dead_lettered_without_reaching_the_relay(
    db_dsn: str, nats_server: Any, stream: tuple[str, str]
) -> None:
    """The attack: a 50 MB key pushed the relay to 1 GB RSS. The claim now dead-letters such
    a row in the database; the relay never loads it, and the events around it flow."""
    root, name = stream
    with pytest.raises(InvalidEventError, match="key is 52428800 bytes"):
        event(f"{root}.orders", key="k" * 50 * 1024 * 1024)
    before = event(f"{root}.orders", key="a")
    write_events(db_dsn, [before])
    big_key = insert_raw(db_dsn, f"{root}.orders", key_sql="repeat('k', 50 * 1024 * 1024)")
    big_headers = insert_raw(
        db_dsn,
        f"{root}.orders",
        headers_sql="jsonb_build_object('x-blob', repeat(md5(random()::text), 65536))",
    )
    after = event(f"{root}.orders", key="b")
    write_events(db_dsn, [after])
    publisher = Recording(NatsPublisher.from_url(nats_server.url))
    async with running_relay(db_dsn, publisher):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert set(dead) == {str(big_key), str(big_headers)}
    assert dead[str(big_key)]["last_error"].startswith("relay: key is 52428800 bytes, over what")
    assert "headers are 2097" in dead[str(big_headers)]["last_error"]
    assert dead[str(big_key)]["attempts"] == 1
    assert publisher.largest_key < 1024
    assert publisher.largest_headers < 64 * 1024
    messages = await stored(nats_server.url, name, f"{root}.>")
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [
        str(before.event_id),
        str(after.event_id),
    ]


def test_nul_and_oversized_fields_fail_in_python_and_leave_the_transaction_usable(
    db_dsn: str,
) -> None:
    """NUL used to reach PostgreSQL (``ValueError``/``DataError`` at insert, the caller's
    transaction broken); a key over Outbox's limit went in. Both fail before any SQL now."""
    outbox = Outbox()
    with psycopg.connect(db_dsn) as conn:
        with conn.transaction():
            with pytest.raises(InvalidEventError, match="control character"):
                outbox.put(conn, event("orders", aggregate_id="42\x00"))
            with pytest.raises(InvalidEventError, match="over max_key_bytes=1024"):
                outbox.put(conn, event("orders", key="k" * 2048))
            outbox.put(conn, event("orders", key="k" * 1024))
        with pytest.raises(InvalidEventError, match="more than 10000 events"):
            with outbox.transaction(conn) as tx:
                tx.put_many(event("orders") for _ in range(10_001))
    assert count(db_dsn) == 1


# -- Redis ------------------------------------------------------------------------------------


@pytest.fixture
async def redis_client() -> AsyncIterator[Any]:
    client: Any = redis.asyncio.Redis.from_url(redis_url())
    namespace = unique_name("outboxkit-test-hostile")
    client.namespace = namespace
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter(f"*{namespace}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_a_topic_cannot_trim_another_applications_redis_stream(
    db_dsn: str, redis_client: Any
) -> None:
    """The attack: topic = another application's stream, with ``maxlen=5``: its 100 entries
    were trimmed to 5. With ``stream_prefix`` the event lands in the relay's namespace."""
    ns = redis_client.namespace
    victim = f"billing:{ns}"
    for i in range(100):
        await redis_client.xadd(victim, {"n": i})
    prefix = f"outbox:{ns}:"
    hostile = event(victim)
    write_events(db_dsn, [hostile])
    url = f"{redis_url()}?maxlen=5&stream_prefix={prefix}"
    async with running_relay(db_dsn, RedisStreamsPublisher.from_url(url)):
        await wait_for(lambda: count(db_dsn) == 0, what="outbox drained")
    assert await redis_client.xlen(victim) == 100
    landed = await redis_client.xrange(prefix + victim)
    assert [f[b"ce_id"].decode() for _, f in landed] == [str(hostile.event_id)]


async def test_a_redis_allow_list_dead_letters_topics_outside_it(
    db_dsn: str, redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ns = redis_client.namespace
    victim = f"billing:{ns}"
    await redis_client.xadd(victim, {"n": 0})
    allowed = event(f"orders:{ns}")
    refused = event(victim)
    write_events(db_dsn, [allowed, refused])
    url = f"{redis_url()}?maxlen=1&allow=orders:*&dedup_window=60"
    with caplog.at_level(logging.WARNING, logger="outboxkit.redis"):
        async with running_relay(db_dsn, RedisStreamsPublisher.from_url(url)):
            await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    assert not [r for r in caplog.records if "stream_prefix" in r.getMessage()]
    dead = dead_letters(db_dsn)
    assert list(dead) == [str(refused.event_id)]
    assert (
        "not in the publisher's allow-list (allow=orders:*)"
        in dead[str(refused.event_id)]["last_error"]
    )
    assert await redis_client.xlen(victim) == 1
    assert await redis_client.xlen(f"orders:{ns}") == 1
    assert await redis_client.exists(f"{DEDUP_KEY_PREFIX}{victim}:{refused.event_id}") == 0


async def test_an_unrestricted_redis_publisher_warns_once_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = RedisStreamsPublisher.from_url(redis_url())
    with caplog.at_level(logging.WARNING, logger="outboxkit.redis"):
        await publisher.start()
        await publisher.publish_batch([])
    await publisher.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "any key of the database" in warnings[0] and "stream_prefix=" in warnings[0]


# -- RabbitMQ ---------------------------------------------------------------------------------


@pytest.fixture
async def amqp_channel() -> AsyncIterator[tuple[aio_pika.abc.AbstractChannel, list[str]]]:
    connection = await aio_pika.connect(rabbitmq_url(), timeout=10)
    channel = await connection.channel()
    queues: list[str] = []
    try:
        yield channel, queues
    finally:
        for queue in queues:
            await channel.queue_delete(queue)
        await connection.close()


async def _depth(channel: aio_pika.abc.AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    return declared.declaration_result.message_count or 0


async def test_on_the_default_exchange_a_topic_cannot_fill_another_applications_queue(
    db_dsn: str,
    amqp_channel: tuple[aio_pika.abc.AbstractChannel, list[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel, queues = amqp_channel
    victim = unique_name("billing-refunds")
    namespaced = f"outbox.{victim}"
    orders = unique_name("orders")
    for queue in (victim, namespaced, orders):
        await channel.declare_queue(queue, durable=True)
        queues.append(queue)
    # A prefix: the event's topic names the victim, the message lands in the namespace.
    hostile = event(victim)
    write_events(db_dsn, [hostile])
    url = f"{rabbitmq_url()}?exchange=&routing_key_prefix=outbox."
    async with running_relay(db_dsn, RabbitMQPublisher.from_url(url)):
        await wait_for(lambda: count(db_dsn) == 0, what="outbox drained")
    assert await _depth(channel, victim) == 0
    assert await _depth(channel, namespaced) == 1
    # An allow-list: the event naming the victim is dead-lettered with the reason.
    allowed, refused = event(orders), event(victim)
    write_events(db_dsn, [allowed, refused])
    # A row written by SQL with a header name the AMQP client would truncate to 128 bytes.
    long_name = insert_raw(db_dsn, orders, headers={"x-" + "h" * 200: "1"})
    url = f"{rabbitmq_url()}?exchange=&allow=orders_*"
    async with running_relay(db_dsn, RabbitMQPublisher.from_url(url)):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert set(dead) == {str(refused.event_id), str(long_name)}
    assert "not in the publisher's allow-list" in dead[str(refused.event_id)]["last_error"]
    assert "is over 128 bytes" in dead[str(long_name)]["last_error"]
    assert await _depth(channel, victim) == 0
    assert await _depth(channel, orders) == 1
    # Without either, the relay says what it risks, once.
    with caplog.at_level(logging.WARNING, logger="outboxkit.rabbitmq"):
        publisher = RabbitMQPublisher.from_url(f"{rabbitmq_url()}?exchange=")
        await publisher.start()
        await publisher.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "outboxkit.rabbitmq"]
    assert len(warnings) == 1 and "any queue of the vhost" in warnings[0]
