"""Helpers for running relays in tests: in-process, or as real processes to kill."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg

from outboxkit import Event, OutboundMessage, Outbox, Publisher, PublishResult, Relay


class TimingPublisher:
    """A publisher that confirms at once and notes when each event was first published."""

    name = "recorder"

    def __init__(self) -> None:
        self.at: dict[uuid.UUID, float] = {}  # event id -> time.monotonic()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def publish_batch(self, messages: list[OutboundMessage]) -> list[PublishResult]:
        now = time.monotonic()
        for m in messages:
            self.at.setdefault(m.event_id, now)
        return [PublishResult.success()] * len(messages)


@contextlib.asynccontextmanager
async def running_relay(dsn: str, publisher: Publisher, **options: Any) -> AsyncIterator[Relay]:
    """A Relay running in this event loop for the duration of the block."""
    defaults: dict[str, Any] = {
        "poll_interval": 0.2,
        "lease": 10.0,
        "retry_base": 0.05,
        "retry_cap": 0.5,
    }
    relay = Relay(dsn, publisher, **{**defaults, **options})
    task = asyncio.create_task(relay.run())
    try:
        yield relay
    finally:
        relay.stop()
        await asyncio.wait_for(task, timeout=30)


async def wait_for(
    condition: Callable[[], Awaitable[bool]] | Callable[[], bool],
    *,
    timeout: float = 20.0,
    interval: float = 0.05,
    what: str = "condition",
) -> None:
    """Poll until ``condition()`` is true; fail the test with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


def rows(dsn: str, where: str = "true", table: str = "outbox") -> list[dict[str, Any]]:
    """The outbox rows matching ``where`` (test-only SQL, fixed strings)."""
    from psycopg.rows import dict_row

    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(f"SELECT * FROM {table} WHERE {where} ORDER BY id")
        return cur.fetchall()


def count(dsn: str, where: str = "true", table: str = "outbox") -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table} WHERE {where}").fetchone()
        assert row is not None
        return int(row[0])


def write_events(dsn: str, events: list[Event], *, outbox: Outbox | None = None) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        (outbox or Outbox()).put_many(conn, events)


def make_events(topic: str, n: int, *, keys: int = 5) -> list[Event]:
    return [
        Event(
            topic=topic,
            event_type="order.placed",
            payload={"order": i, "note": "é ✓"},
            key=f"customer-{i % keys}",
            aggregate_type="order",
            aggregate_id=str(i),
            headers={"tenant": "acme", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
        )
        for i in range(n)
    ]


def relay_connections(dsn: str) -> dict[str, int]:
    """The relay's connections to ``dsn``'s database now, by application_name."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE 'outboxkit-relay:%'"
            " GROUP BY 1"
        ).fetchall()
    return {name: int(n) for name, n in rows}


class Writers:
    """A thread per database committing 5 events a transaction, every 4th rolled back
    (PostgreSQL's or MariaDB's, by the URL)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.committed: dict[str, list[uuid.UUID]] = {}
        self.rolled_back: list[uuid.UUID] = []
        self._threads: list[threading.Thread] = []

    def start(self, dsn: str, topic: str) -> None:
        ids = self.committed.setdefault(dsn, [])
        thread = threading.Thread(target=self._write, args=(dsn, topic, ids), daemon=True)
        self._threads.append(thread)
        thread.start()

    def _write(self, dsn: str, topic: str, ids: list[uuid.UUID]) -> None:
        if dsn.startswith(("mysql://", "mariadb://")):
            self._write_mariadb(dsn, topic, ids)
            return
        outbox = Outbox()
        with psycopg.connect(dsn) as conn:
            n = 0
            while not self.stop.is_set():
                events = make_events(topic, 5)
                with conn.transaction(force_rollback=n % 4 == 3):
                    outbox.put_many(conn, events)
                (self.rolled_back if n % 4 == 3 else ids).extend(e.event_id for e in events)
                n += 1
                time.sleep(0.02)

    def _write_mariadb(self, dsn: str, topic: str, ids: list[uuid.UUID]) -> None:
        import pymysql

        from outboxkit.backends.mariadb.sql import connect_args

        outbox = Outbox()  # (the connection picks MariaDB's storage)
        conn = pymysql.connect(**connect_args(dsn))
        try:
            n = 0
            while not self.stop.is_set():
                events = make_events(topic, 5)
                outbox.put_many(conn, events)
                if n % 4 == 3:
                    conn.rollback()
                    self.rolled_back.extend(e.event_id for e in events)
                else:
                    conn.commit()
                    ids.extend(e.event_id for e in events)
                n += 1
                time.sleep(0.02)
        finally:
            conn.close()

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(10)
