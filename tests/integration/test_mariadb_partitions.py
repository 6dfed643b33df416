"""Changing an ordered MariaDB table's partition count (``migrate --ordered --partitions N
--repartition``), with PostgreSQL's rules: refused without ``--repartition``, refused while
a relay is alive; then the table is rewritten, the leases start over, a relay's claim from
before is fenced out, and every key's events still reach the broker in order."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import pymysql
import pytest
from click.testing import CliRunner

from outboxkit import Event, Outbox
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.queue import MariaDBQueueStore
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.ops.cli.app import main
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.queue.store import DONE, HeadsOnly
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import mariadb_execute, own_database
from tests.support.relaying import running_relay, wait_for

KEYS = 12


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    with own_database(mariadb_server, "rp") as url:
        yield url


class Recorder:
    """Confirms every message at once and records (key, n) in publish order."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        for m in messages:
            self.seen.append((str(m.key), int(orjson.loads(m.payload)["n"])))
        return [PublishResult.success()] * len(messages)


class Writer:
    """Ordered writes in the background, one event per transaction, keys in turn."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sent = {f"k{i}": 0 for i in range(KEYS)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = pymysql.connect(**connect_args(self.url))
        outbox = Outbox(storage="mariadb", ordered=True)
        try:
            i = 0
            while not self._stop.is_set():
                key = f"k{i % KEYS}"
                event = Event(topic="t", event_type="e", key=key, payload={"n": self.sent[key]})
                outbox.put(conn, event)
                conn.commit()
                self.sent[key] += 1
                i += 1
        finally:
            conn.close()

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def total(self) -> int:
        return sum(self.sent.values())


def _partitions(url: str) -> tuple[int, int]:
    """(P as the column computes it, rows of the partitions table)."""
    ((expression,),) = mariadb_execute(
        url,
        "SELECT GENERATION_EXPRESSION FROM information_schema.COLUMNS WHERE TABLE_SCHEMA ="
        " DATABASE() AND TABLE_NAME = 'outbox' AND COLUMN_NAME = 'partition'",
    )
    ((rows,),) = mariadb_execute(url, "SELECT COUNT(*) FROM outbox_partitions")
    return int(str(expression).split()[-1]), int(rows)


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["migrate", *args], catch_exceptions=False)


def _make(*columns: Any) -> tuple[Any, ...]:
    return columns


async def _ghost_claim(url: str) -> tuple[MariaDBQueueStore[Any], Any]:
    """A relay 'ghost' that took partition 0 and claimed its heads, then froze (no
    heartbeat row, so migrate sees no live relay); its claim is still leased."""
    mariadb_execute(
        url,
        "UPDATE outbox_partitions SET owner = 'ghost',"
        " expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR WHERE `partition` = 0",
    )
    store: MariaDBQueueStore[Any] = MariaDBQueueStore(url, "outbox", _make, ordered=True)
    claim = await store.claim(
        limit=50, lease=1.5, token=uuid.uuid4(), owner="ghost", max_attempts=9, policy=HeadsOnly()
    )
    assert claim is not None
    return store, claim


async def test_repartition_while_writing_keeps_every_keys_order(url: str) -> None:
    migrate(url, kind="ordered", partitions=8)
    recorder = Recorder()
    # A lease long enough that a loaded machine never lets the relays' heartbeats lapse while
    # the refusal is checked (a lapsed one counts as stopped, and the change would go ahead).
    options: dict[str, Any] = {"ordered": True, "lease": 6.0, "poll_interval": 0.05}
    with Writer(url) as writer:
        async with (
            running_relay(url, recorder, relay_id="a", **options),
            running_relay(url, recorder, relay_id="b", **options),
        ):
            await wait_for(lambda: len(recorder.seen) > 50, what="relays publish")
            refused = _cli("--dsn", url, "--ordered", "--partitions", "4")
            assert refused.exit_code != 0 and "--repartition" in refused.output
            alive = _cli("--dsn", url, "--ordered", "--partitions", "4", "--repartition")
            assert alive.exit_code != 0 and "while relays are running (a, b)" in alive.output
            assert _partitions(url) == (8, 8)
        # the relays stopped (their heartbeat rows went with them); a frozen one's claim
        # stays leased through the change
        store, claim = await asyncio.wait_for(_ghost_claim(url), 10)
        done = _cli("--dsn", url, "--ordered", "--partitions", "4", "--repartition")
        assert done.exit_code == 0, done.output
        assert "repartitioned from 8 to 4" in done.output
        assert _partitions(url) == (4, 4)
        # its late settle changes nothing: the leases started over
        settled = await store.settle(claim, [DONE] * len(claim.ids))
        assert list(settled.ids) == [] and settled.lost == len(claim.ids)
        await store.close()
        async with (
            running_relay(url, recorder, relay_id="a", **options),
            running_relay(url, recorder, relay_id="b", **options),
        ):
            await asyncio.sleep(0.3)  # more writes under the new count
            writer.__exit__()
            await wait_for(
                lambda: not mariadb_execute(url, "SELECT 1 FROM outbox LIMIT 1"),
                timeout=20,
                what="the outbox drains",
            )
    per_key: dict[str, list[int]] = {}
    for key, n in recorder.seen:
        per_key.setdefault(key, []).append(n)
    assert sum(len(v) for v in per_key.values()) >= writer.total()
    for key, got in per_key.items():
        assert got == sorted(got), (key, got)  # never an earlier event after a later one
        assert sorted(set(got)) == list(range(writer.sent[key])), key  # none lost
