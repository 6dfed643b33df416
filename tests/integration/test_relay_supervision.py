"""The relay's observers count only what the table holds, and every failure is cleaned up.

Real PostgreSQL and a real NATS JetStream. Failures are the database's own: a trigger
that refuses the settle or the claim, a lock held past a statement timeout, a NOTIFY the
LISTEN connection cannot decode; a publisher whose start fails after it connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from outboxkit import Relay
from outboxkit.backends.postgres.postgres import Statements
from outboxkit.ops.metrics import RelayMetrics
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.publishers.nats import NatsPublisher
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events
from tests.support.servers import consume_nats, ensure_stream

# A trigger raising on the rows a statement touches: a statement error on a working
# connection (SQLSTATE P0001), not a connectivity problem.
_REFUSE = """
CREATE OR REPLACE FUNCTION refuse_by_test() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refused by the test'; END $$;
CREATE TRIGGER refuse_by_test BEFORE {operation} ON outbox
FOR EACH ROW EXECUTE FUNCTION refuse_by_test();
"""
_ALLOW = "DROP TRIGGER refuse_by_test ON outbox"


class _Publisher(NatsPublisher):
    """A real NATS publisher that records its lifecycle; its first start() can fail after
    connecting (as a start that checks a stream would), its publishes can be held."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_first_start = False
        self.starts = self.closes = 0
        self.gate: asyncio.Event | None = None
        self.publishing = asyncio.Event()

    async def start(self) -> None:
        await super().start()
        self.starts += 1
        if self.fail_first_start and self.starts == 1:
            raise RuntimeError("stream check failed at start")

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        self.publishing.set()
        if self.gate is not None:
            await self.gate.wait()
        return await super().publish_batch(messages)

    async def close(self) -> None:
        self.closes += 1
        await super().close()


def _execute(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement)  # test-only fixed SQL


def _relay_connections(dsn: str) -> list[str]:
    """application_name of every relay connection open on the test's database."""
    dbname = urllib.parse.urlsplit(dsn).path.lstrip("/")
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT application_name FROM pg_stat_activity"
            " WHERE datname = %s AND application_name LIKE 'outboxkit-relay:%%'",
            (dbname,),
        ).fetchall()
    return sorted(r[0] for r in found)


async def _no_relay_connections(dsn: str) -> None:
    # a closed connection's backend leaves pg_stat_activity a moment later
    await wait_for(lambda: not _relay_connections(dsn), timeout=5, what="relay connections gone")


def _with_params(dsn: str, **params: str) -> str:
    parts = urllib.parse.urlsplit(dsn)
    query = urllib.parse.parse_qsl(parts.query) + list(params.items())
    return parts._replace(
        query=urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
    ).geturl()


def _sample(metrics: RelayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def _stream(nats_url: str) -> str:
    root = f"sup{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_url, root.upper(), [f"{root}.>"])
    return root


# -- observers count what the table holds ----------------------------------------------


async def test_a_settle_the_database_refuses_is_not_counted_as_published(
    db_dsn: str, nats_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "outboxkit.relay")
    root = await _stream(nats_server.url)
    topic = f"{root}.orders"
    write_events(db_dsn, make_events(topic, 20))
    _execute(db_dsn, _REFUSE.format(operation="DELETE"))
    metrics = RelayMetrics(db_dsn, process_metrics=False)
    publisher = _Publisher.from_url(nats_server.url)
    async with running_relay(db_dsn, publisher, observer=metrics, lease=2.0) as relay:
        await wait_for(
            lambda: any("settle failed" in r.getMessage() for r in caplog.records),
            what="the settle refused by the trigger",
        )
        delivered = await consume_nats(nats_server.url, root.upper(), f"{root}.>", 20, 10.0)
        assert len(delivered) == 20, "the broker confirmed the whole batch"
        assert count(db_dsn) == 20, "the rows are still in the table, leased"
        assert relay.stats.published == 0
        assert _sample(metrics, "outboxkit_events_published_total", topic=topic) == 0
        assert _sample(metrics, "outboxkit_publish_latency_seconds_count", topic=topic) == 0
        assert relay.stats.db_errors >= 1 and relay.stats.db_reconnects == 0
        assert _sample(metrics, "outboxkit_db_errors_total") >= 1

        # the trigger gone, the rows are re-published once their lease ends and settle
        _execute(db_dsn, _ALLOW)
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="the rows settled")
        await wait_for(lambda: relay.stats.published == 20, what="the settle counted")
    assert _sample(metrics, "outboxkit_events_published_total", topic=topic) == 20
    assert _sample(metrics, "outboxkit_db_reconnects_total") == 0


async def test_a_fenced_settle_counts_only_the_rows_it_settled(
    db_dsn: str, nats_server: Any
) -> None:
    root = await _stream(nats_server.url)
    topic = f"{root}.orders"
    write_events(db_dsn, make_events(topic, 10))
    metrics = RelayMetrics(db_dsn, process_metrics=False)
    publisher = _Publisher.from_url(nats_server.url)
    publisher.gate = asyncio.Event()
    options = {"lease": 1.0, "publish_timeout": 30.0, "batch_size": 10, "max_in_flight": 1}
    async with running_relay(db_dsn, publisher, observer=metrics, **options) as relay:
        await asyncio.wait_for(publisher.publishing.wait(), 10)
        # Four rows' lease runs out while the publish is held (as if the relay's lease
        # heartbeat could not reach the database), and another relay re-claims them at
        # once, in the same transaction: the heartbeat's next extension is fenced out.
        with psycopg.connect(db_dsn, autocommit=True) as conn, conn.transaction():
            conn.execute(
                "UPDATE outbox SET available_at = now() - interval '1 second'"
                " WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 4)"
            )
            params = {
                "lease": 60.0,
                "token": uuid.uuid4(),
                "relay_id": "other",
                "limit": 4,
                "max_attempts": 10,
            }
            taken = conn.execute(Statements().claim_batch, {**params, "commit": None}).fetchall()
        assert len(taken) == 4, "another relay re-claimed four rows"
        publisher.gate.set()
        await wait_for(lambda: count(db_dsn) == 4, what="the relay's settle of six rows")
        await wait_for(lambda: relay.stats.lease_lost == 4, what="the lost leases counted")
    assert relay.stats.published == 6
    assert _sample(metrics, "outboxkit_events_published_total", topic=topic) == 6
    assert _sample(metrics, "outboxkit_lease_lost_total") == 4


@pytest.mark.parametrize("failure", ["trigger", "lock"])
async def test_a_claim_statement_that_fails_on_a_working_connection_is_not_a_reconnect(
    db_dsn: str, nats_server: Any, failure: str
) -> None:
    root = await _stream(nats_server.url)
    write_events(db_dsn, make_events(f"{root}.orders", 5))
    # "lock": a statement timeout (QueryCanceled: an OperationalError, like a lost connection)
    dsn = _with_params(db_dsn, options="-c statement_timeout=300") if failure == "lock" else db_dsn
    if failure == "trigger":
        _execute(db_dsn, _REFUSE.format(operation="UPDATE"))
    metrics = RelayMetrics(dsn, process_metrics=False)
    locker = psycopg.connect(db_dsn)
    try:
        if failure == "lock":
            locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        async with running_relay(
            dsn, _Publisher.from_url(nats_server.url), observer=metrics
        ) as relay:
            metrics.attach(relay)

            def failures() -> int:
                return getattr(relay.stats, "db_errors", 0) + relay.stats.db_reconnects

            await wait_for(lambda: failures() >= 2, what="claims failing")
            assert relay.stats.db_reconnects == 0
            assert _sample(metrics, "outboxkit_db_reconnects_total") == 0
            assert relay.stats.db_errors >= 2
            assert _sample(metrics, "outboxkit_db_errors_total") >= 2
            if failure == "trigger":
                _execute(db_dsn, _ALLOW)
            else:
                locker.rollback()
            await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="claims working again")
        assert relay.stats.published == 5 and relay.stats.db_reconnects == 0
    finally:
        locker.close()


# -- a relay that cleans up after every failure ----------------------------------------


async def test_a_publisher_start_that_fails_closes_everything_and_the_relay_can_run_again(
    db_dsn: str, nats_server: Any
) -> None:
    root = await _stream(nats_server.url)
    publisher = _Publisher.from_url(nats_server.url)
    publisher.fail_first_start = True
    relay = Relay(db_dsn, publisher, poll_interval=0.2, lease=10.0)
    with pytest.raises(RuntimeError, match="stream check failed"):
        await asyncio.wait_for(relay.run(), 30)
    assert publisher.closes == 1, "the publisher's half-made connection was closed"
    await _no_relay_connections(db_dsn)

    write_events(db_dsn, make_events(f"{root}.orders", 7))
    task = asyncio.create_task(relay.run())
    try:
        # (The settle's DELETE is visible before the relay has counted it: wait for both.)
        await wait_for(
            lambda: count(db_dsn) == 0 and relay.stats.published == 7,
            what="the second run relaying",
        )
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)
    assert publisher.starts == 2 and publisher.closes == 2
    await _no_relay_connections(db_dsn)


async def test_a_listener_that_dies_stops_the_relay_with_its_error_and_closes_everything(
    db_dsn: str, nats_server: Any
) -> None:
    # The relay's connections read text as ASCII: a NOTIFY payload with an 'é' cannot be
    # decoded by the LISTEN connection, an error that is not a lost connection to retry.
    dsn = _with_params(db_dsn, client_encoding="SQL_ASCII")
    publisher = _Publisher.from_url(nats_server.url)
    relay = Relay(dsn, publisher, poll_interval=0.2, lease=10.0)
    task = asyncio.create_task(relay.run())
    try:
        await wait_for(
            lambda: "outboxkit-relay:listen" in _relay_connections(db_dsn), what="LISTEN"
        )
        channel = Statements().channel
        with psycopg.connect(db_dsn, autocommit=True) as conn:
            for _ in range(100):  # until the listener has subscribed and read one
                conn.execute("SELECT pg_notify(%s, 'café')", (channel,))
                done, _ = await asyncio.wait({task}, timeout=0.1)
                if done:
                    break
        done, _ = await asyncio.wait({task}, timeout=15)
        assert done, "the relay stopped by itself once its listener died"
        with pytest.raises(UnicodeDecodeError):
            task.result()
    finally:
        relay.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 30)
    assert publisher.starts == 1 and publisher.closes == 1, "the publisher was closed"
    await _no_relay_connections(db_dsn)
    # and it is not "already running": a run after a failure is allowed (it sees the stop)
    await asyncio.wait_for(relay.run(), 10)
