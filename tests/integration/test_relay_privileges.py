"""A role that cannot settle is a configuration fault: the relay stops, says so, /readyz is 503.

Before (issue 26, item 5): a role without DELETE published every event once per lease,
then the crash-loop guard dead-lettered all of them ("claimed 10 times and never
settled"), with /readyz "ready" throughout; a role without UPDATE failed every claim,
ready all along. Now a refused settle (SQLSTATE 42501, 25006) stops the claiming until
the settle goes through, and a role that cannot settle is refused at start the same way:
nothing is published again until it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from outboxkit.ops.metrics import RelayMetrics
from outboxkit.publishers.webhook import WebhookPublisher
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events
from tests.support.webhook_server import WebhookServer

# Sub-second publish timeouts: run alone under xdist, so another test's load cannot trip them.
pytestmark = pytest.mark.exclusive

EVENTS = 20


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    hooks = WebhookServer()
    hooks.start()
    yield hooks
    hooks.stop()


@contextlib.contextmanager
def _role(dsn: str, privileges: str, *, read_only: bool = False) -> Iterator[tuple[str, str]]:
    """A login role with SELECT on every table and ``privileges`` on the outbox: (name, DSN)."""
    name = f"okrole_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {name} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {name}")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {name}")
        conn.execute(f"GRANT {privileges} ON outbox TO {name}")
        if read_only:
            conn.execute(f"ALTER ROLE {name} SET default_transaction_read_only = on")
    try:
        yield name, make_conninfo(dsn, user=name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
            conn.execute(f"DROP OWNED BY {name}")
            conn.execute(f"DROP ROLE {name}")


def _grant(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and "refuses the relay's" in r.getMessage()
    ]


async def test_a_role_without_delete_publishes_each_event_once_and_waits_for_the_grant(
    db_dsn: str, server: WebhookServer, caplog: pytest.LogCaptureFixture
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:6]}"
    write_events(db_dsn, make_events(topic, EVENTS))
    publisher = WebhookPublisher.from_url(f"{server.url()}?timeout=2")
    with _role(db_dsn, "SELECT, INSERT, UPDATE") as (name, role_dsn):
        # The start-up check sees UPDATE and no DELETE: refused before anything is published.
        async with running_relay(role_dsn, publisher, lease=1.0, max_attempts=3) as relay:
            metrics = RelayMetrics(db_dsn, process_metrics=False)
            metrics.attach(relay)
            await wait_for(lambda: relay.status().denied is not None, what="the refusal")
            await asyncio.sleep(4 * 1.0)  # four leases: before, each one meant a publish more
            assert server.requests == [], "nothing is published by a role that cannot settle"
            assert count(db_dsn, "status = 2") == 0, "no false dead letter"
            reason = metrics.not_ready_reason()
            assert reason is not None and "refuses the relay's writes" in reason
            assert len(_refusals(caplog)) == 1, "said once, in one line"
            _grant(db_dsn, f"GRANT DELETE ON outbox TO {name}")
            await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the backlog to drain")
            assert relay.status().denied is None
            assert metrics.not_ready_reason() is None or "refuses" not in (
                metrics.not_ready_reason() or ""
            )
    ids = [r.headers["ce-id"] for r in server.requests]
    assert len(ids) == EVENTS and len(set(ids)) == EVENTS, "each event published exactly once"


async def test_a_settle_refused_mid_run_stops_the_claiming_until_it_goes_through(
    db_dsn: str, server: WebhookServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The privilege is revoked while the relay runs: the batch it published is settled once
    the grant is back, and nothing is claimed (or published again) meanwhile."""
    topic = f"orders-{uuid.uuid4().hex[:6]}"
    publisher = WebhookPublisher.from_url(f"{server.url()}?timeout=2")
    with _role(db_dsn, "SELECT, INSERT, UPDATE, DELETE") as (name, role_dsn):
        async with running_relay(role_dsn, publisher, lease=1.0, max_attempts=3) as relay:
            write_events(db_dsn, make_events(topic, 5))
            await wait_for(lambda: count(db_dsn) == 0, what="the first events to be published")
            _grant(db_dsn, f"REVOKE DELETE ON outbox FROM {name}")
            write_events(db_dsn, make_events(topic, EVENTS))
            await wait_for(lambda: relay.status().denied is not None, what="the refusal")
            published = len(server.requests)
            await asyncio.sleep(4 * 1.0)
            assert len(server.requests) == published, "nothing published while refused"
            assert count(db_dsn, "status = 2") == 0, "no false dead letter"
            _grant(db_dsn, f"GRANT DELETE ON outbox TO {name}")
            await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the backlog to drain")
    ids = [r.headers["ce-id"] for r in server.requests]
    assert len(ids) == EVENTS + 5 and len(set(ids)) == EVENTS + 5, "each published once"
    assert len(_refusals(caplog)) == 1


@pytest.mark.parametrize(
    ("privileges", "read_only"),
    [("SELECT, INSERT, DELETE", False), ("SELECT, INSERT, UPDATE, DELETE", True)],
    ids=["without-update", "read-only"],
)
async def test_a_role_that_cannot_claim_is_refused_at_start_and_not_ready(
    db_dsn: str,
    server: WebhookServer,
    caplog: pytest.LogCaptureFixture,
    privileges: str,
    read_only: bool,
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:6]}"
    write_events(db_dsn, make_events(topic, EVENTS))
    publisher = WebhookPublisher.from_url(f"{server.url()}?timeout=2")
    with _role(db_dsn, privileges, read_only=read_only) as (name, role_dsn):
        async with running_relay(role_dsn, publisher, lease=1.0) as relay:
            metrics = RelayMetrics(db_dsn, process_metrics=False)
            metrics.attach(relay)
            await wait_for(lambda: relay.status().denied is not None, what="the refusal")
            await asyncio.sleep(2.0)
            reason = metrics.not_ready_reason()
            assert reason is not None and "refuses the relay's writes" in reason
            assert server.requests == []
            assert len(_refusals(caplog)) == 1
            if read_only:
                _grant(db_dsn, f"ALTER ROLE {name} RESET default_transaction_read_only")
                _grant(
                    db_dsn,
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    f" WHERE usename = '{name}'",
                )
            else:
                _grant(db_dsn, f"GRANT UPDATE ON outbox TO {name}")
            await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the backlog to drain")
    assert len({r.headers["ce-id"] for r in server.requests}) == EVENTS
