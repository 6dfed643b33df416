"""/readyz of a WAL relay (`--source cdc`): its replication stream lost, and as a standby.

A relay runs in this process with its /healthz /readyz app on a free port, against the
embedded PostgreSQL with wal_level=logical and the session's NATS. The stream is cut by
terminating the slot's walsender again and again (the server stays up: the gauges still
read the table, so only the stream can make the relay not ready). A lost stream makes
/readyz 503 once it has been down for the database's grace (3 x gauge interval + 5 s),
never before; a standby waiting for the slot stays ready (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg

from outboxkit import Relay
from outboxkit.ops.http import metrics_app, serving
from outboxkit.ops.metrics import RelayMetrics
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.testing import free_port
from tests.integration.test_readyz_broker import _readyz as _get
from tests.integration.test_readyz_broker import _until
from tests.support.cdc_relaying import running_cdc_relay, setup_cdc, slot_active, write_wal
from tests.support.relaying import make_events, wait_for, write_events
from tests.support.servers import ensure_stream

GAUGE_INTERVAL = 0.3
GRACE = 3 * GAUGE_INTERVAL + 5  # RelayMetrics' stale_after: the database's grace
UP_WITHIN = 10.0  # the stream's outage ends after 5 s without a loss, then the next take


@contextlib.asynccontextmanager
async def _cdc_relay_serving(dsn: str, nats_url: str) -> AsyncIterator[tuple[Relay, str]]:
    """A `Relay(source="cdc")` with its metrics app on a free port; yields it and the base URL."""
    metrics = RelayMetrics(dsn, gauge_interval=GAUGE_INTERVAL, process_metrics=False)
    relay = Relay(
        dsn,
        NatsPublisher.from_url(nats_url),
        source="cdc",
        observer=metrics,
        retry_base=0.05,
        retry_cap=0.5,
    )
    metrics.attach(relay)
    port = free_port()
    task = asyncio.create_task(relay.run())
    try:
        async with serving(metrics_app(metrics), "127.0.0.1", port):
            gauges = asyncio.create_task(metrics.run_gauges())
            try:
                yield relay, f"http://127.0.0.1:{port}"
            finally:
                gauges.cancel()
                await asyncio.gather(gauges, return_exceptions=True)
    finally:
        relay.stop()
        await asyncio.wait_for(task, timeout=30)


class _StreamCutter:
    """Terminates the slot's walsender every 0.1 s from a thread until stopped."""

    def __init__(self, dsn: str, slot: str) -> None:
        self.dsn, self.slot = dsn, slot
        self.terminated = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.wait(0.1):
                cur = conn.execute(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(active_pid))"
                    " FROM pg_replication_slots WHERE slot_name = %s AND active_pid IS NOT NULL",
                    (self.slot,),
                )
                row = cur.fetchone()
                self.terminated += int(row[0]) if row else 0

    def __enter__(self) -> _StreamCutter:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


async def test_readyz_fails_after_the_grace_while_the_stream_is_cut_and_recovers(
    logical_db_dsn: str, nats_server: Any
) -> None:
    slot = setup_cdc(logical_db_dsn)
    root = f"cdc{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    events = make_events(f"{root}.orders", 30)
    async with _cdc_relay_serving(logical_db_dsn, nats_server.url) as (relay, base):
        await _until(f"{base}/readyz", 200, 15.0)
        write_events(logical_db_dsn, events[:10])
        await wait_for(lambda: relay.stats.published == 10, what="published before the cut")
        with _StreamCutter(logical_db_dsn, slot) as cutter:
            write_wal(logical_db_dsn, events[10:20])
            down_after, body = await _until(f"{base}/readyz", 503, GRACE + 5.0)
            assert cutter.terminated >= 2, "the stream was not cut"
            assert (await _get(f"{base}/healthz"))[0] == 200  # alive: no restart wanted
        # not before the grace: a stream lost for less is reconnecting, not down
        assert down_after >= GRACE - 0.5, (down_after, body)
        match = re.fullmatch(r"not ready: replication stream down since (\d+)s \((\w+)\)\n", body)
        assert match is not None, body
        assert int(match[1]) >= int(GRACE) - 1
        _, body = await _until(f"{base}/readyz", 200, UP_WITHIN)
        assert body == "ready\n"
        write_events(logical_db_dsn, events[20:])
        # nothing committed during the cut was skipped
        await wait_for(lambda: relay.stats.published >= 30, what="all published after the cut")
        assert relay.cdc is not None and relay.cdc.streaming


async def test_a_standby_waiting_for_the_slot_stays_alive_and_ready_then_takes_over(
    logical_db_dsn: str, nats_server: Any
) -> None:
    slot = setup_cdc(logical_db_dsn)
    async with contextlib.AsyncExitStack() as stack:
        active = await stack.enter_async_context(
            running_cdc_relay(logical_db_dsn, NatsPublisher.from_url(nats_server.url))
        )
        await wait_for(lambda: slot_active(logical_db_dsn, slot), what="the active relay streams")
        relay, base = await stack.enter_async_context(
            _cdc_relay_serving(logical_db_dsn, nats_server.url)
        )
        assert relay.cdc is not None
        cdc = relay.cdc
        await wait_for(lambda: cdc.standby, what="the second relay waits as a standby")
        started = time.monotonic()
        while time.monotonic() - started < GRACE + 1.0:  # longer than a lost stream's grace
            assert await _get(f"{base}/readyz") == (200, "ready\n")
            assert (await _get(f"{base}/healthz"))[0] == 200
            assert cdc.standby and not cdc.streaming
            await asyncio.sleep(0.5)
        active.stop()
        await wait_for(lambda: cdc.streaming, what="the standby takes over")
        assert not cdc.standby
        assert await _get(f"{base}/readyz") == (200, "ready\n")
