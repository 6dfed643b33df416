"""The Redis Streams publisher against real redis-servers, through the real relay.

The machine's Redis carries these tests (unique stream names, deleted after). The delivery
guarantees every broker shares (a killed relay, Redis SIGKILLed mid-stream, an event carried
whole, with and without the dedup script) are in tests/integration/brokers/.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from outboxkit import Event, Outbox
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.redis import DEDUP_KEY_PREFIX, RedisStreamsPublisher
from outboxkit.testing import spawn_relay
from tests.support.local_brokers import OwnRedis, redis_url
from tests.support.relaying import (
    count,
    make_events,
    rows,
    running_relay,
    wait_for,
    write_events,
)
from tests.support.servers import unique_name


class Streams:
    """Stream names of one test on a Redis server, read back and deleted after."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: Any = redis.asyncio.Redis.from_url(url)
        self.names: list[str] = []

    def name(self, prefix: str = "orders") -> str:
        stream = unique_name(f"outboxkit-test-{prefix}")
        self.names.append(stream)
        return stream

    async def entries(self, stream: str) -> list[dict[bytes, bytes]]:
        return [fields for _id, fields in await self.client.xrange(stream)]

    async def ids(self, *streams: str) -> list[str]:
        return [f[b"ce_id"].decode() for s in streams for f in await self.entries(s)]

    async def cleanup(self) -> None:
        if self.names:
            await self.client.delete(*self.names)
            for stream in self.names:
                keys = await self.client.keys(f"{DEDUP_KEY_PREFIX}{stream}:*")
                if keys:
                    await self.client.delete(*keys)
        await self.client.aclose()


@pytest.fixture
async def streams() -> AsyncIterator[Streams]:
    helper = Streams(redis_url())
    try:
        yield helper
    finally:
        await helper.cleanup()


def _message(topic: str, event: Event) -> OutboundMessage:
    import datetime as dt

    return OutboundMessage(
        event_id=event.event_id,
        topic=topic,
        key=event.key,
        event_type=event.event_type,
        aggregate_type=event.aggregate_type,
        aggregate_id=event.aggregate_id,
        payload=event.payload,
        headers=event.headers,
        created_at=dt.datetime.now(dt.UTC),
    )


async def test_maxlen_trims_the_stream_approximately(streams: Streams) -> None:
    stream = streams.name()
    publisher = RedisStreamsPublisher.from_url(streams.url + "?maxlen=10")
    await publisher.start()
    try:
        events = make_events(stream, 400)
        results = await publisher.publish_batch([_message(stream, e) for e in events])
    finally:
        await publisher.close()
    assert all(r.ok for r in results)
    length = await streams.client.xlen(stream)
    assert 10 <= length < 400, "MAXLEN ~ 10 trimmed whole nodes"
    assert (await streams.ids(stream))[-1] == str(events[-1].event_id)


async def test_dedup_window_adds_a_republished_event_once_and_reports_success(
    streams: Streams,
) -> None:
    stream = streams.name()
    publisher = RedisStreamsPublisher.from_url(streams.url + "?dedup_window=60")
    await publisher.start()
    try:
        event = make_events(stream, 1)[0]
        first = await publisher.publish_batch([_message(stream, event)])
        again = await publisher.publish_batch([_message(stream, event)] * 2)
    finally:
        await publisher.close()
    assert [r.ok for r in first + again] == [True, True, True]
    assert await streams.ids(stream) == [str(event.event_id)]
    ttl = await streams.client.ttl(f"{DEDUP_KEY_PREFIX}{stream}:{event.event_id}")
    assert 0 < ttl <= 60


async def test_key_of_another_type_dead_letters_at_once_and_leaves_no_dedup_mark(
    db_dsn: str, streams: Streams
) -> None:
    stream = streams.name()
    await streams.client.set(stream, "not a stream")
    [event] = make_events(stream, 1)
    write_events(db_dsn, [event])
    publisher = RedisStreamsPublisher.from_url(streams.url + "?dedup_window=60")
    async with running_relay(db_dsn, publisher):
        await wait_for(lambda: count(db_dsn, "status = 2") == 1, what="dead-lettered")
    [row] = rows(db_dsn)
    assert row["attempts"] == 1
    assert "is not a stream" in row["last_error"]
    assert not await streams.client.exists(f"{DEDUP_KEY_PREFIX}{stream}:{event.event_id}"), (
        "the failed XADD released its dedup mark, so a replay is not skipped"
    )


async def test_too_few_replicas_for_wait_is_retried_with_a_clear_error(
    db_dsn: str, streams: Streams
) -> None:
    stream = streams.name()
    write_events(db_dsn, make_events(stream, 3))
    url = streams.url + "?wait_replicas=1&wait_timeout=0.1"
    async with running_relay(db_dsn, RedisStreamsPublisher.from_url(url)):
        await wait_for(lambda: count(db_dsn, "last_error IS NOT NULL") == 3, what="retries")
    assert count(db_dsn, "status = 0") == 3, "pending, not dead-lettered"
    assert "only 0 of 1 replica(s) acknowledged" in rows(db_dsn)[0]["last_error"]


async def test_relay_command_routes_event_and_aggregate_types_to_their_streams(
    db_dsn: str, streams: Streams, tmp_path: Path
) -> None:
    orders, customers = streams.name("orders"), streams.name("customers")
    placed = Event(topic="domain", event_type="order.placed", payload={"n": 1})
    moved = Event(
        topic="domain", event_type="address.changed", aggregate_type="customer", payload={}
    )
    other = Event(topic=streams.name("unrouted"), event_type="invoice.paid", payload={})
    write_events(db_dsn, [placed, moved, other])
    relay = spawn_relay(
        db_dsn,
        streams.url,
        tmp_path / "relay.log",
        "--route",
        f"order.*={orders}",
        "--route",
        f"aggregate:customer={customers}",
    )
    try:
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the relay process drains")
        relay.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(relay.wait, 15) == 0
    finally:
        if relay.poll() is None:
            relay.kill()
    assert await streams.ids(orders) == [str(placed.event_id)]
    assert await streams.ids(customers) == [str(moved.event_id)]
    assert await streams.ids(other.topic) == [str(other.event_id)], "no rule: keeps its topic"


@pytest.mark.parametrize("query", ["", "?dedup_window=60"])
async def test_a_field_over_proto_max_bulk_len_is_dead_lettered_alone(
    db_dsn: str, tmp_path: Path, query: str
) -> None:
    # Over proto-max-bulk-len the server answers "invalid bulk length" and closes the
    # connection: the whole pipeline failed, every event of the batch with it, forever.
    server = OwnRedis(tmp_path / "redis")
    server.start()
    client: Any = redis.asyncio.Redis.from_url(server.url)
    try:
        await client.config_set("proto-max-bulk-len", str(1024 * 1024))  # its smallest
        stream = unique_name("files")
        healthy = make_events(stream, 20)
        big = Event(topic=stream, event_type="file.stored", payload=b"x" * (1024 * 1024 + 1))
        write_events(
            db_dsn, [*healthy[:10], big, *healthy[10:]], outbox=Outbox(max_payload_bytes=2 << 20)
        )
        publisher = RedisStreamsPublisher.from_url(server.url + query)
        async with running_relay(db_dsn, publisher) as relay:
            await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="all settled")
        [dead] = rows(db_dsn)
        assert dead["event_id"] == big.event_id
        assert (dead["status"], dead["attempts"]) == (2, 1), "dead-lettered at once"
        assert "proto-max-bulk-len is 1 048 576" in dead["last_error"], dead["last_error"]
        assert relay.stats.released == 0, "the connection was never lost"
        ids = [f[b"ce_id"].decode() for _id, f in await client.xrange(stream)]
        assert ids == [str(e.event_id) for e in healthy]
    finally:
        await client.aclose()
        server.kill()
