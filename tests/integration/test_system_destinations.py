"""Topics that reach a broker's system destinations, against real servers (issue 26, item 3).

The attack: a topic of ``$JS.API.STREAM.DELETE.VICTIM`` passed ``Event()``, was published,
and the NATS server deleted the stream VICTIM. ``Event()`` refuses such topics; rows written
around it (plain SQL) are inserted here, and each publisher must dead-letter them at once with
the reason, publish nothing of them and lose nothing else, unless the deployment allowed the
destination explicitly (``allow_system=`` in the broker URL).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aio_pika
import nats
import nats.js.errors
import pytest
import redis.asyncio
from nats.js.api import StreamConfig

from outboxkit import Event
from outboxkit.errors import InvalidEventError
from outboxkit.publishers import from_url
from tests.integration.test_hostile_events import dead_letters, insert_raw
from tests.support.local_brokers import rabbitmq_url, redis_url
from tests.support.relaying import count, running_relay, wait_for, write_events
from tests.support.servers import consume_kafka, consume_nats, unique_name


def event(topic: str, **fields: Any) -> Event:
    return Event(topic=topic, event_type="order.placed", payload={"n": 1}, **fields)


# -- NATS ------------------------------------------------------------------------------------


@pytest.fixture
async def victim(
    nats_server: Any,
) -> AsyncIterator[tuple[Any, str, str, Callable[[], Awaitable[None]]]]:
    """Another application's stream of 5 messages: (jetstream, name, subject root, refill)."""
    root = unique_name("victim").replace("-", "_")
    name = root.upper()
    nc = await nats.connect(nats_server.url, connect_timeout=5, allow_reconnect=False)
    js = nc.jetstream()

    async def fill() -> None:
        await js.add_stream(StreamConfig(name=name, subjects=[f"{root}.>"]))
        for i in range(5):
            await js.publish(f"{root}.ledger", f"{i}".encode())

    await fill()
    try:
        yield js, name, root, fill
    finally:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_stream(name)
        await nc.close()


async def stream_messages(js: Any, name: str) -> int | None:
    """How many messages the stream holds; None once it no longer exists."""
    try:
        info = await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        return None
    return int(info.state.messages)


async def test_a_jetstream_api_topic_deletes_a_stream_only_where_it_is_allowed(
    db_dsn: str, nats_server: Any, victim: tuple[Any, str, str, Callable[[], Awaitable[None]]]
) -> None:
    js, name, root, refill = victim
    topic = f"$JS.API.STREAM.DELETE.{name}"
    with pytest.raises(InvalidEventError, match="is a system destination"):
        event(topic)
    assert event(topic, allow_system_topic=True).topic == topic

    # The naive harm, with the check turned off: the relay's publish deletes the stream.
    insert_raw(db_dsn, topic)
    unchecked = from_url(f"{nats_server.url}?allow_system=$JS.API.STREAM.DELETE.*")
    async with running_relay(db_dsn, unchecked, max_attempts=1):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    assert await stream_messages(js, name) is None
    await refill()

    # By default: refused at once, never sent; the stream and the events around it survive.
    hostile_id = insert_raw(db_dsn, topic)
    inbox_id = insert_raw(db_dsn, "_INBOX.abcdef")
    honest = event(f"{root}.orders")
    write_events(db_dsn, [honest])
    async with running_relay(db_dsn, from_url(nats_server.url), max_attempts=5):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert str(hostile_id) in dead and str(inbox_id) in dead
    assert dead[str(hostile_id)]["attempts"] == 1  # at once, not after max_attempts
    assert "is a system destination" in dead[str(hostile_id)]["last_error"]
    assert "allow_system=" in dead[str(hostile_id)]["last_error"]
    assert await stream_messages(js, name) == 6  # its 5, and the honest event
    stored = await consume_nats(nats_server.url, name, f"{root}.orders", None)
    assert [m.headers["Nats-Msg-Id"] for m in stored] == [str(honest.event_id)]


# -- Kafka -----------------------------------------------------------------------------------


async def test_a_kafka_internal_topic_is_dead_lettered_unless_allowed(
    db_dsn: str, kafka_broker: Any
) -> None:
    internal = f"__{unique_name('outboxkit-internal')}"
    honest_topic = unique_name("orders")
    hostile_id = insert_raw(db_dsn, internal)
    honest = event(honest_topic)
    write_events(db_dsn, [honest])
    async with running_relay(db_dsn, from_url(kafka_broker.url), max_attempts=5):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    dead = dead_letters(db_dsn)
    assert list(dead) == [str(hostile_id)]
    assert dead[str(hostile_id)]["attempts"] == 1
    assert "a Kafka internal topic" in dead[str(hostile_id)]["last_error"]
    records = consume_kafka(kafka_broker.bootstrap, honest_topic, 1)
    assert [dict(r.headers() or [])["ce_id"].decode() for r in records] == [str(honest.event_id)]


# -- RabbitMQ ----------------------------------------------------------------------------------


async def test_an_amq_routing_key_on_the_default_exchange_is_dead_lettered(db_dsn: str) -> None:
    """On the default exchange a routing key is a queue name; ``amq.*`` ones are RabbitMQ's
    (server-named queues of other clients, the direct reply-to pseudo-queue)."""
    connection = await aio_pika.connect(rabbitmq_url(), timeout=10)
    channel = await connection.channel()
    # A server-named queue: an RPC client's private reply queue.
    private = await channel.declare_queue("", exclusive=True)
    assert private.name.startswith("amq.gen-")
    try:
        hostile_id = insert_raw(db_dsn, private.name)
        url = f"{rabbitmq_url()}?exchange="
        async with running_relay(db_dsn, from_url(url), max_attempts=5):
            await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
        dead = dead_letters(db_dsn)
        assert list(dead) == [str(hostile_id)]
        assert dead[str(hostile_id)]["attempts"] == 1
        assert "a name RabbitMQ reserves" in dead[str(hostile_id)]["last_error"]
        declared = await channel.declare_queue(private.name, passive=True)
        assert declared.declaration_result.message_count == 0
    finally:
        await connection.close()


# -- Redis -------------------------------------------------------------------------------------


async def test_a_topic_cannot_name_the_redis_publishers_own_dedup_keys(db_dsn: str) -> None:
    """With ``dedup_window`` an event is skipped when its dedup key exists: a stream written
    at a dedup key's name would make the publisher skip that event for good."""
    client: Any = redis.asyncio.Redis.from_url(redis_url())
    stream = unique_name("orders")
    dedup_key = f"outboxkit:dedup:{stream}:{uuid.uuid4()}"
    try:
        hostile_id = insert_raw(db_dsn, dedup_key)
        honest = event(stream)
        write_events(db_dsn, [honest])
        async with running_relay(db_dsn, from_url(f"{redis_url()}?dedup_window=60")):
            await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
        dead = dead_letters(db_dsn)
        assert list(dead) == [str(hostile_id)]
        assert "the Redis publisher's own dedup keys" in dead[str(hostile_id)]["last_error"]
        assert await client.exists(dedup_key) == 0
        assert await client.xlen(stream) == 1
    finally:
        keys = [k async for k in client.scan_iter(f"*{stream}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
