"""The Kinesis publisher against moto's server (real HTTP, real boto3): partition keys and
per-key order read back from every shard, the record limit to the byte, a missing stream.

The guarantees every broker shares (a killed relay, an outage mid-stream, an event carried
whole, the dead-lettering of an oversized event) are in tests/integration/brokers/.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import orjson
import pytest

from outboxkit import Event
from outboxkit.consumers.kinesis import decode
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.kinesis import MAX_RECORD_BYTES, KinesisPublisher
from outboxkit.wire import kinesis as wire
from tests.support.aws_sizes import at_limit
from tests.support.moto_sqs import MotoSqs, running_moto
from tests.support.relaying import count, make_events, rows, running_relay, wait_for, write_events
from tests.support.servers import unique_name


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoSqs]:
    with running_moto(monkeypatch) as server:
        yield server


def _url(moto: MotoSqs, stream: str) -> str:
    return moto.url(stream).replace("sqs://", "kinesis://", 1)


def _record_size(message: OutboundMessage) -> int:
    """What Kinesis counts against its 1 MiB: the data blob plus the partition key."""
    data, key = wire.encode(message)
    return len(data) + len(key.encode())


async def test_records_keep_per_key_order_on_their_shard_and_keyless_ones_spread_by_id(
    db_dsn: str, moto: MotoSqs
) -> None:
    stream = unique_name("orders")
    moto.create_stream(stream, shards=4)
    events = make_events("orders", 200, keys=7)
    keyless = [Event(topic="orders", event_type="order.note", payload={"n": i}) for i in range(20)]
    write_events(db_dsn, events + keyless)
    async with running_relay(db_dsn, KinesisPublisher.from_url(_url(moto, stream)), batch_size=60):
        await wait_for(lambda: count(db_dsn) == 0, what="outbox drained")
    shards = moto.client("kinesis").list_shards(StreamName=stream)["Shards"]
    records = await asyncio.to_thread(moto.read_stream, stream)
    got = [decode(stream, r) for r in records]
    assert sorted(str(g.event_id) for g in got) == sorted(str(e.event_id) for e in events + keyless)
    for key in {e.key for e in events}:
        on_stream = [g.event_id for g in got if g.key == key]
        assert on_stream == [e.event_id for e in events if e.key == key], f"order of {key}"
    ids = {str(e.event_id) for e in keyless}
    assert {r["PartitionKey"] for r in records if r["PartitionKey"] in ids} == ids
    assert len(shards) == 4


async def test_a_record_of_exactly_1_mib_is_published_and_one_byte_more_dead_lettered(
    moto: MotoSqs,
) -> None:
    stream = unique_name("files")
    moto.create_stream(stream, shards=1)
    fits = at_limit(_record_size, MAX_RECORD_BYTES)
    over = at_limit(_record_size, MAX_RECORD_BYTES, over=1)
    publisher = KinesisPublisher.from_url(_url(moto, stream))
    await publisher.start()
    try:
        ok, refused = await publisher.publish_batch([fits, over])
    finally:
        await publisher.close()
    assert ok.ok, ok
    assert (refused.retryable, refused.error_class) == (False, "message_too_large")
    assert "1 048 577 bytes" in str(refused.error) and "1 048 576" in str(refused.error)
    [record] = await asyncio.to_thread(moto.read_stream, stream)
    got = decode(stream, record)
    assert got.event_id == fits.event_id and got.payload == fits.payload
    assert orjson.loads(record["Data"])["data"] == orjson.loads(fits.payload)


async def test_a_missing_stream_is_dead_lettered_at_once_naming_it(
    db_dsn: str, moto: MotoSqs
) -> None:
    missing = unique_name("nowhere")
    write_events(db_dsn, [Event(topic="orders", event_type="order.placed", payload={"n": 1})])
    async with running_relay(db_dsn, KinesisPublisher.from_url(_url(moto, missing))):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="settled")
    [dead] = rows(db_dsn)
    assert (dead["status"], dead["attempts"]) == (2, 1), "dead-lettered at once"
    assert missing in dead["last_error"] and "does not exist" in dead["last_error"]
