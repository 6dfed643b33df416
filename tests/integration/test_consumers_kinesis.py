"""The Kinesis runner against moto's server: checkpoints after the inbox commit, a restart
that resumes from them, a checkpoint lost (the inbox absorbs the re-read), and a reshard
that keeps every key's order.

The shared consumer scenario (once, retried in place, poison skipped) is in
tests/integration/test_consumers.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outboxkit.backends.postgres.migrate import migrate_inbox
from outboxkit.consumers.base import ReceivedEvent
from outboxkit.consumers.kinesis import KinesisConsumer
from outboxkit.publishers.kinesis import KinesisPublisher
from outboxkit.testing import TcpProxy
from tests.support.moto_sqs import MotoSqs, running_moto
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events
from tests.support.servers import unique_name


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoSqs]:
    with running_moto(monkeypatch) as server:
        yield server


class Applied:
    """The handler: what it applied, in the order it applied it."""

    def __init__(self, hold_after: int | None = None) -> None:
        self.ids: list[uuid.UUID] = []
        self.keys: list[str | None] = []
        # With hold_after=N the handler waits at its N+1st call until `go` is set: a test
        # cuts the database there, so records are still to come when it goes away.
        self.hold_after = hold_after
        self.go = asyncio.Event()

    async def __call__(self, tx: psycopg.AsyncConnection[Any], event: ReceivedEvent) -> None:
        if self.hold_after is not None and len(self.ids) >= self.hold_after:
            await self.go.wait()
        self.ids.append(event.event_id)
        self.keys.append(event.key)


async def _consume(
    dsn: str, moto: MotoSqs, stream: str, applied: Applied, until: int
) -> KinesisConsumer:
    runner = KinesisConsumer(
        dsn,
        applied,
        consumer="billing",
        stream=stream,
        region="us-east-1",
        endpoint_url=moto.endpoint,
        poll_interval=0.05,
        refresh_interval=0.3,
    )
    task = asyncio.create_task(runner.run())
    try:

        def done() -> bool:
            if task.done():
                task.result()
            return runner.stats.applied + runner.stats.duplicates >= until

        await wait_for(done, timeout=30, interval=0.05, what="the runner to read the stream")
        await asyncio.sleep(0.3)  # anything beyond `until` would show now
    finally:
        runner.stop()
        await asyncio.wait_for(task, 20)
    return runner


async def _relay(dsn: str, moto: MotoSqs, stream: str, n: int, keys: int) -> list[Any]:
    events = make_events("orders", n, keys=keys)
    write_events(dsn, events)
    publisher = KinesisPublisher(stream, region="us-east-1", endpoint_url=moto.endpoint)
    async with running_relay(dsn, publisher):
        await wait_for(lambda: count(dsn) == 0, what="relayed")
    return events


async def test_a_restarted_runner_resumes_from_its_checkpoints_and_a_lost_one_costs_no_effect(
    db_dsn: str, moto: MotoSqs
) -> None:
    migrate_inbox(db_dsn)
    stream = unique_name("orders")
    moto.create_stream(stream, shards=2)
    first = await _relay(db_dsn, moto, stream, 60, keys=16)
    a = Applied()
    runner = await _consume(db_dsn, moto, stream, a, 60)
    assert sorted(a.ids) == sorted(e.event_id for e in first)
    assert count(db_dsn, "consumer_name = 'billing'", table="outboxkit_kinesis_checkpoints") == 2
    second = await _relay(db_dsn, moto, stream, 30, keys=16)
    b = Applied()
    runner = await _consume(db_dsn, moto, stream, b, 30)
    assert sorted(b.ids) == sorted(e.event_id for e in second), "only the new records"
    assert runner.stats.duplicates == 0, "nothing before the checkpoints was read again"
    # The runner died after its inbox commits, before the checkpoint: the records are read
    # again, and the inbox skips every one.
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM outboxkit_kinesis_checkpoints")
    c = Applied()
    runner = await _consume(db_dsn, moto, stream, c, 90)
    assert c.ids == [] and runner.stats.duplicates == 90 and runner.stats.applied == 0


async def test_a_split_shard_is_read_to_its_end_and_marked_finished_keys_in_order(
    db_dsn: str, moto: MotoSqs
) -> None:
    """Resharding as moto models it: the parent is closed and listed with its two children.

    (moto 5 keeps routing a split stream's records to the closed parent, so the children
    stay empty here; what this proves is that a closed shard is recognised, read to its
    end, marked finished, and that nothing is lost, doubled or reordered meanwhile.)
    """
    migrate_inbox(db_dsn)
    stream = unique_name("orders")
    moto.create_stream(stream, shards=1)
    before = await _relay(db_dsn, moto, stream, 60, keys=6)
    kinesis = moto.client("kinesis")
    [parent] = kinesis.list_shards(StreamName=stream)["Shards"]
    kinesis.split_shard(
        StreamName=stream,
        ShardToSplit=parent["ShardId"],
        NewStartingHashKey=str(2**127),
    )
    await asyncio.to_thread(_wait_active, kinesis, stream)
    after = await _relay(db_dsn, moto, stream, 60, keys=6)
    shards = kinesis.list_shards(StreamName=stream)["Shards"]
    assert len(shards) == 3
    children = [s["ShardId"] for s in shards if s.get("ParentShardId") == parent["ShardId"]]
    assert len(children) == 2
    applied = Applied()
    await _consume(db_dsn, moto, stream, applied, 120)
    events = before + after
    assert sorted(applied.ids) == sorted(e.event_id for e in events), "each record once"
    for key in {e.key for e in events}:
        got = [i for i, k in zip(applied.ids, applied.keys, strict=True) if k == key]
        assert got == [e.event_id for e in events if e.key == key], f"order of {key}"
    assert count(db_dsn, "finished", table="outboxkit_kinesis_checkpoints") == 1, "the parent"


def _wait_active(kinesis: Any, stream: str) -> None:
    import time

    for _ in range(100):
        status = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        if status["StreamStatus"] == "ACTIVE":
            return
        time.sleep(0.05)


async def test_a_database_outage_skips_no_record_however_many_deliveries_fail(
    db_dsn: str, moto: MotoSqs
) -> None:
    """max_deliveries=2 gives up on a record whose handler fails; a database that is away
    fails every record, and none of them may be given up for it."""
    migrate_inbox(db_dsn)
    stream = unique_name("orders")
    moto.create_stream(stream, shards=1)
    events = await _relay(db_dsn, moto, stream, 20, keys=4)
    info = psycopg.conninfo.conninfo_to_dict(db_dsn)
    proxy = TcpProxy(str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432)).start()
    info.update(host="127.0.0.1", port=str(proxy.port))
    through = psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v})
    applied = Applied(hold_after=5)
    runner = KinesisConsumer(
        through,
        applied,
        consumer="billing",
        stream=stream,
        region="us-east-1",
        endpoint_url=moto.endpoint,
        poll_interval=0.05,
        max_deliveries=2,
        retry_delay=0.05,
    )
    task = asyncio.create_task(runner.run())
    try:
        await wait_for(lambda: runner.stats.applied >= 5, timeout=30, what="some applied")
        proxy.cut()  # the 6th record's transaction is open in the handler, 15 more to come
        applied.go.set()
        await wait_for(lambda: runner.stats.failed >= 6, timeout=30, what="failing deliveries")
        proxy.resume()
        await wait_for(lambda: runner.stats.applied >= 20, timeout=60, what="all applied")
    finally:
        runner.stop()
        await asyncio.wait_for(task, 20)
        proxy.close()
    assert runner.stats.dead_lettered == 0, "the outage gave no record up"
    assert sorted(set(applied.ids)) == sorted(e.event_id for e in events)
    for key in {e.key for e in events}:
        got = [i for i, k in zip(applied.ids, applied.keys, strict=True) if k == key]
        deduped = list(dict.fromkeys(got))  # a handler call whose commit was lost repeats
        assert deduped == [e.event_id for e in events if e.key == key], f"order of {key}"
