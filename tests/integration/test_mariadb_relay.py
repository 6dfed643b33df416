"""The relay on MariaDB end to end: events written with PyMySQL (some rolled back) reach
NATS JetStream exactly once each, checked from the broker's side."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import nats
import pymysql
import pytest

import outboxkit
from outboxkit import Event, Outbox, Relay
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import ConfigurationError
from outboxkit.publishers.nats import NatsPublisher
from tests.support.mariadb import MariaDB
from tests.support.servers import unique_name


def _database(server: MariaDB) -> str:
    name = unique_name("r")
    admin = pymysql.connect(**server.connect_args(), autocommit=True)
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
    finally:
        admin.close()
    url = server.url_for(name)
    migrate(url)
    return url


def _count(url: str) -> int:
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) FROM outbox")
            return int(cur.fetchone()[0])
    finally:
        conn.close()


async def _drained(url: str, running: list[asyncio.Task[None]], timeout: float) -> None:
    """Until the outbox is empty (or a relay ended)."""
    async with asyncio.timeout(timeout):
        while _count(url) and not any(t.done() for t in running):
            await asyncio.sleep(0.05)


async def _stop(relays: list[Relay], running: list[asyncio.Task[None]]) -> None:
    for relay in relays:
        relay.stop()
    await asyncio.gather(*running)


async def _stream_ids(url: str, stream: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        ids = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(stream, seq)
            ids.append((msg.headers or {}).get("Nats-Msg-Id", ""))
        await js.delete_stream(stream)
        return ids
    finally:
        await nc.close()


async def test_relay_publishes_committed_events_to_nats_once_each_and_never_rolled_back_ones(
    mariadb_server: MariaDB, nats_server: Any
) -> None:
    url = _database(mariadb_server)
    tag = uuid.uuid4().hex[:8]
    stream = f"MARIADB_{tag.upper()}"
    outbox = Outbox(table="outbox")  # the README's own line: the connection picks MariaDB's
    conn = pymysql.connect(**connect_args(url))
    committed: list[str] = []
    try:
        for i in range(40):
            event = Event(topic=f"{tag}.orders", event_type="order.placed", payload={"n": i})
            outbox.put(conn, event)
            if i % 4 == 3:
                conn.rollback()  # a quarter rolled back: never published
            else:
                conn.commit()
                committed.append(str(event.event_id))
    finally:
        conn.close()
    publisher = NatsPublisher.from_url(f"{nats_server.url}?stream={stream}&subjects={tag}.>")
    relay = Relay(url, publisher, poll_interval=0.05, batch_size=7)
    running = asyncio.create_task(relay.run())
    try:
        async with asyncio.timeout(20):
            while _count(url) and not running.done():
                await asyncio.sleep(0.05)
    finally:
        relay.stop()
        await running
    assert _count(url) == 0
    assert sorted(await _stream_ids(nats_server.url, stream)) == sorted(committed)


def test_relay_refuses_what_mariadb_cannot_do_in_one_line(mariadb_server: MariaDB) -> None:
    publisher = NatsPublisher.from_url("nats://127.0.0.1:4222")
    url = mariadb_server.url_for("shop")
    with pytest.raises(ConfigurationError, match="need PostgreSQL"):
        Relay(url, publisher, source="cdc")


async def test_ordered_relays_publish_each_key_in_commit_order_across_relays(
    mariadb_server: MariaDB, nats_server: Any
) -> None:
    """Two ordered relays on one MariaDB outbox, writers racing on four hot keys: per key,
    the stream holds the events in the order their transactions committed."""
    url = _database(mariadb_server)
    migrate(url, kind="ordered", partitions=4)
    tag = uuid.uuid4().hex[:8]
    stream = f"MARIADB_ORDERED_{tag.upper()}"
    broker = f"{nats_server.url}?stream={stream}&subjects={tag}.>"
    relays = [
        Relay(url, NatsPublisher.from_url(broker), ordered=True, poll_interval=0.02,
              batch_size=10, relay_id=f"r{i}", lease=6.0)
        for i in range(2)
    ]  # fmt: skip
    running = [asyncio.create_task(r.run()) for r in relays]
    committed: dict[str, list[str]] = {}
    lock = asyncio.Lock()

    def write(writer: int) -> list[tuple[str, list[str]]]:
        outbox = Outbox(storage="mariadb", ordered=True)
        conn = pymysql.connect(**connect_args(url))
        done = []
        try:
            for i in range(30):
                key = f"k{(writer + i) % 4}"
                events = [
                    Event(topic=f"{tag}.o", event_type="t", key=key, payload={"i": i, "j": j})
                    for j in range(2)
                ]
                outbox.put_many(conn, events)
                with conn.cursor() as cur:  # the key's commit counter, taken after the ids
                    cur.execute("UPDATE seq SET n = n + 1 WHERE k = %s", (key,))
                    cur.execute("SELECT n FROM seq WHERE k = %s", (key,))
                    n = cur.fetchone()[0]
                if i % 4 == 3:
                    conn.rollback()
                else:
                    conn.commit()
                    done.append((f"{key}:{n:06d}", [str(e.event_id) for e in events]))
        finally:
            conn.close()
        return done

    admin = pymysql.connect(**connect_args(url), autocommit=True)
    with admin.cursor() as cur:
        cur.execute("CREATE TABLE seq (k VARCHAR(8) PRIMARY KEY, n INT NOT NULL DEFAULT 0)")
        cur.execute("INSERT INTO seq (k) VALUES ('k0'), ('k1'), ('k2'), ('k3')")
    admin.close()
    try:
        results = await asyncio.gather(*(asyncio.to_thread(write, w) for w in range(3)))
        async with lock:
            for order, ids in sorted(x for r in results for x in r):
                committed.setdefault(order.split(":")[0], []).extend(ids)
        await _drained(url, running, 40)
    finally:
        await _stop(relays, running)
    assert _count(url) == 0
    key_of = {e: k for k, ids in committed.items() for e in ids}
    published: dict[str, list[str]] = {}
    for event_id in await _stream_ids(nats_server.url, stream):
        published.setdefault(key_of[event_id], []).append(event_id)
    assert published == committed


def test_outboxkit_migrate_and_relay_take_a_mysql_url(
    mariadb_server: MariaDB, nats_server: Any
) -> None:
    url = mariadb_server.url_for(unique_name("c"))
    admin = pymysql.connect(**mariadb_server.connect_args(), autocommit=True)
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {url.rsplit('/', 1)[1]}")
    admin.close()
    env = {**os.environ, "PYTHONPATH": str(Path(outboxkit.__file__).parents[1])}
    cli = [sys.executable, "-m", "outboxkit"]
    done = subprocess.run([*cli, "migrate", "--dsn", url], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    tag = uuid.uuid4().hex[:8]
    conn = pymysql.connect(**connect_args(url))
    events = [Event(topic=f"{tag}.x", event_type="t", payload={"n": i}) for i in range(5)]
    Outbox(storage="mariadb").put_many(conn, events)
    conn.commit()
    conn.close()
    stream = f"MARIADB_CLI_{tag.upper()}"
    broker = f"{nats_server.url}?stream={stream}&subjects={tag}.>"
    relay = subprocess.Popen(
        [*cli, "relay", "--dsn", url, "--broker", broker, "--poll-interval", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 20
        while _count(url) and time.monotonic() < deadline and relay.poll() is None:
            time.sleep(0.05)
    finally:
        relay.send_signal(signal.SIGTERM)
        output = relay.communicate(timeout=20)[0]
    assert relay.returncode == 0, output
    assert "MariaDB has no LISTEN/NOTIFY" in output
    ids = asyncio.run(_stream_ids(nats_server.url, stream))
    assert sorted(ids) == sorted(str(e.event_id) for e in events)


async def test_three_relays_share_the_table_while_writers_write_and_publish_each_event_once(
    mariadb_server: MariaDB, nats_server: Any
) -> None:
    url = _database(mariadb_server)
    tag = uuid.uuid4().hex[:8]
    stream = f"MARIADB_SHARE_{tag.upper()}"
    broker = f"{nats_server.url}?stream={stream}&subjects={tag}.>"
    relays = [
        Relay(url, NatsPublisher.from_url(broker), poll_interval=0.02, batch_size=5)
        for _ in range(3)
    ]
    running = [asyncio.create_task(r.run()) for r in relays]
    committed: list[str] = []

    def write(writer: int) -> None:
        outbox = Outbox(storage="mariadb")
        conn = pymysql.connect(**connect_args(url))
        try:
            for i in range(60):
                events = [
                    Event(topic=f"{tag}.w{writer}", event_type="t", payload={"i": i, "j": j})
                    for j in range(3)
                ]
                outbox.put_many(conn, events)
                if i % 4 == 3:
                    conn.rollback()
                else:
                    conn.commit()
                    committed.extend(str(e.event_id) for e in events)
        finally:
            conn.close()

    try:
        await asyncio.gather(*(asyncio.to_thread(write, w) for w in range(3)))
        await _drained(url, running, 30)
    finally:
        await _stop(relays, running)
    assert _count(url) == 0
    published = await _stream_ids(nats_server.url, stream)
    assert len(published) == len(committed) == 3 * 45 * 3
    # JetStream drops a repeated Nats-Msg-Id: the relays' own count shows none was sent twice.
    assert sum(r.stats.published for r in relays) == len(committed)
    assert sorted(published) == sorted(committed)
