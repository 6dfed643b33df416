"""Consumer runners under real faults: acknowledged only after commit, so nothing is lost.

Redis Streams is the broker here (the machine's server, a stream of each test's own): a
consumer process is SIGKILLed inside its handler's transaction, and the consumer's database
connection is cut by a TCP proxy mid-stream.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis.asyncio

from outboxkit.backends.postgres.migrate import migrate_inbox
from outboxkit.consumers.base import ReceivedEvent
from outboxkit.consumers.redis import RedisStreamsConsumer
from outboxkit.publishers.redis import RedisStreamsPublisher
from tests.support.local_brokers import redis_url
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events
from tests.support.servers import unique_name

CREATE_LEDGER = "CREATE TABLE ledger (id serial PRIMARY KEY, event_id uuid NOT NULL, n int)"
INSERT_LEDGER = "INSERT INTO ledger (event_id, n) VALUES (%s, %s)"


@pytest.fixture
def consumer_dsn(db_dsn: str) -> str:
    migrate_inbox(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(CREATE_LEDGER)
    return db_dsn


@pytest.fixture
async def stream() -> AsyncIterator[str]:
    name = unique_name("outboxkit-test-faults")
    yield name
    client = redis.asyncio.Redis.from_url(redis_url())
    await client.delete(name, f"{name}:dead")
    await client.aclose()


def ledger_ids(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [str(r[0]) for r in conn.execute("SELECT event_id FROM ledger").fetchall()]


async def relay_all(dsn: str, stream: str, n: int) -> list[str]:
    events = make_events(stream, n)
    write_events(dsn, events)
    async with running_relay(dsn, RedisStreamsPublisher(redis_url())):
        await wait_for(lambda: count(dsn) == 0, what="the relay to publish")
    return [str(e.event_id) for e in events]


async def record(tx: psycopg.AsyncConnection[Any], event: ReceivedEvent) -> None:
    await tx.execute(INSERT_LEDGER, (event.event_id, event.json()["order"]))


_HANGING_CONSUMER = textwrap.dedent(
    """
    import asyncio, pathlib, sys
    from outboxkit.consumers.redis import RedisStreamsConsumer

    dsn, url, stream, marker = sys.argv[1:5]

    async def handler(tx, event):
        await tx.execute("INSERT INTO ledger (event_id, n) VALUES (%s, 0)", (event.event_id,))
        pathlib.Path(marker).write_text(str(event.event_id))
        await asyncio.sleep(3600)  # inside the open transaction, until SIGKILL

    asyncio.run(RedisStreamsConsumer(
        dsn, handler, consumer="billing", url=url, streams=stream, name="doomed", block=0.1
    ).run())
    """
)


def _spawn_hanging_consumer(
    dsn: str, stream: str, marker: Path, log: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _HANGING_CONSUMER, dsn, redis_url(), stream, str(marker)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def test_consumer_killed_inside_its_handler_leaves_nothing_and_the_next_applies_once(
    consumer_dsn: str, stream: str, tmp_path: Path
) -> None:
    ids = await relay_all(consumer_dsn, stream, 3)
    marker = tmp_path / "in-handler"
    proc = _spawn_hanging_consumer(consumer_dsn, stream, marker, tmp_path / "consumer.log")
    try:
        await wait_for(marker.exists, timeout=30, what="the consumer process to enter its handler")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    # the handler's insert never committed, and nothing was acknowledged
    assert ledger_ids(consumer_dsn) == []
    client = redis.asyncio.Redis.from_url(redis_url())
    try:
        summary = await client.xpending(stream, "billing")
        assert summary["pending"] == 3
        runner = RedisStreamsConsumer(
            consumer_dsn,
            record,
            consumer="billing",
            url=redis_url(),
            streams=stream,
            name="survivor",
            retry_delay=0.05,
            block=0.1,
        )
        task = asyncio.create_task(runner.run())
        try:
            await wait_for(
                lambda: len(ledger_ids(consumer_dsn)) == 3, what="the survivor to apply all"
            )
            await wait_for(lambda: _pending(client, stream), what="every entry acknowledged")
        finally:
            runner.stop()
            await asyncio.wait_for(task, 30)
    finally:
        await client.aclose()
    assert sorted(ledger_ids(consumer_dsn)) == sorted(ids)
    assert runner.stats.applied == 3


async def _pending(client: Any, stream: str) -> bool:
    return (await client.xpending(stream, "billing"))["pending"] == 0


async def test_database_cut_mid_stream_loses_nothing_and_applies_each_event_once(
    consumer_dsn: str, stream: str, proxy_factory: Any
) -> None:
    ids = await relay_all(consumer_dsn, stream, 40)
    parts = urlsplit(consumer_dsn)
    proxy = proxy_factory(parts.hostname or "127.0.0.1", parts.port or 5432)
    via_proxy = urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{proxy.port}"))

    async def slow_record(tx: psycopg.AsyncConnection[Any], event: ReceivedEvent) -> None:
        await record(tx, event)
        await asyncio.sleep(0.02)

    runner = RedisStreamsConsumer(
        via_proxy,
        slow_record,
        consumer="billing",
        url=redis_url(),
        streams=stream,
        max_deliveries=1000,
        retry_delay=0.05,
        block=0.1,
    )
    task = asyncio.create_task(runner.run())
    client = redis.asyncio.Redis.from_url(redis_url())
    try:
        await wait_for(lambda: len(ledger_ids(consumer_dsn)) >= 10, what="a first part applied")
        proxy.cut()  # the database goes away mid-transaction
        await wait_for(lambda: runner.stats.failed >= 3, what="deliveries failing while cut")
        assert len(ledger_ids(consumer_dsn)) < 40
        proxy.resume()
        await wait_for(lambda: len(ledger_ids(consumer_dsn)) >= 40, what="everything applied")
        await wait_for(lambda: _pending(client, stream), what="every entry acknowledged")
    finally:
        runner.stop()
        await asyncio.wait_for(task, 30)
        await client.aclose()
    applied = ledger_ids(consumer_dsn)
    assert len(applied) == 40, "an event was applied twice"
    assert sorted(applied) == sorted(ids)
    assert runner.stats.dead_lettered == 0


async def test_two_runners_receiving_every_event_apply_each_once(
    consumer_dsn: str, stream: str
) -> None:
    # Two consumer groups: each gets every entry, as two deployments of one consumer would
    # after a misconfiguration or a replay. The inbox (one consumer name) applies each once.
    ids = await relay_all(consumer_dsn, stream, 60)
    runners = [
        RedisStreamsConsumer(
            consumer_dsn,
            record,
            consumer="billing",
            url=redis_url(),
            streams=stream,
            group=f"billing-{side}",
            retry_delay=0.05,
            block=0.1,
        )
        for side in ("a", "b")
    ]
    tasks = [asyncio.create_task(r.run()) for r in runners]
    try:
        await wait_for(
            lambda: sum(r.stats.applied + r.stats.duplicates for r in runners) == 120,
            what="both runners to see every event",
        )
    finally:
        for r in runners:
            r.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert sorted(ledger_ids(consumer_dsn)) == sorted(ids)
    assert sum(r.stats.applied for r in runners) == 60
    assert sum(r.stats.duplicates for r in runners) == 60
