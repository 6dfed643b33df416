"""The webhook publisher against a real local HTTP server, through the real relay.

Signatures are checked with the `standardwebhooks` package, an implementation
independent of outboxkit's.

The guarantees every broker shares (a killed relay, an outage mid-stream, an event carried
whole) are in tests/integration/brokers/.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
from collections.abc import Iterator

import pytest
from standardwebhooks import Webhook

from outboxkit import Event
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.webhook import WebhookPublisher
from tests.support.relaying import (
    count,
    make_events,
    rows,
    running_relay,
    wait_for,
    write_events,
)
from tests.support.webhook_server import WebhookServer

SECRET = "whsec_" + base64.b64encode(b"outboxkit test secret, 32 bytes!").decode()


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    hooks = WebhookServer()
    hooks.start()
    yield hooks
    hooks.stop()


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("OUTBOXKIT_TEST_WEBHOOK_SECRET", SECRET)
    return "OUTBOXKIT_TEST_WEBHOOK_SECRET"


def _publisher(server: WebhookServer, path: str = "/hooks", **options: str) -> WebhookPublisher:
    query = "&".join(f"{k}={v}" for k, v in {"timeout": "2", **options}.items())
    return WebhookPublisher.from_url(f"{server.url(path)}?{query}")


async def test_events_are_posted_signed_to_the_templated_path_and_forged_headers_are_dropped(
    db_dsn: str, server: WebhookServer, secret_env: str
) -> None:
    # (What every event carries, ce-* headers included: tests/integration/brokers/.)
    events = make_events("orders/eu", 20)
    raw = Event(
        topic="orders/eu",
        event_type="file.raw",
        payload=b'{"raw": true}',
    )
    events.append(raw)
    # Event() refuses reserved names; a row written around it reaches the relay, and the
    # publisher dead-letters it by Event()'s rules (issue 26), never sends it.
    forged = Event(topic="orders/eu", event_type="file.raw", payload=b"x")
    forged.headers.update({"webhook-id": "forged", "ce-id": "forged", "Idempotency-Key": "forged"})
    write_events(db_dsn, [*events, forged])
    publisher = _publisher(
        server, "/hooks/{topic}/{event_type}", secret_env=secret_env, source="outboxkit"
    )
    assert SECRET not in repr(publisher)
    async with running_relay(db_dsn, publisher):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    [dead] = rows(db_dsn, "status = 2")
    assert dead["event_id"] == forged.event_id
    assert "is reserved by outboxkit" in dead["last_error"]
    by_id = {r.headers["webhook-id"]: r for r in server.requests}
    assert set(by_id) == {str(e.event_id) for e in events}
    assert len(server.requests) == len(events)
    verifier = Webhook(SECRET)
    for e in events:
        request = by_id[str(e.event_id)]
        verifier.verify(request.body, request.headers, json_parse=False)  # raises if forged
        assert request.body == e.payload
        assert request.path == f"/hooks/orders%2Feu/{e.event_type}?source=outboxkit"
        assert request.headers["idempotency-key"] == str(e.event_id)
        assert request.headers["ce-id"] == str(e.event_id)
        assert request.headers["webhook-signature"].startswith("v1,")


@pytest.mark.parametrize("status", [400, 413])
async def test_client_error_is_dead_lettered_at_once_with_status_and_body_excerpt(
    db_dsn: str, server: WebhookServer, status: int
) -> None:
    [event] = make_events("orders", 1)
    write_events(db_dsn, [event])
    server.answer(status, body=b"invalid order: " + b"z" * 2000)
    async with running_relay(db_dsn, _publisher(server)):
        await wait_for(lambda: count(db_dsn, "status = 2") == 1, what="dead-lettered")
    [row] = rows(db_dsn)
    assert row["attempts"] == 1, "no retry for a 4xx"
    assert f"HTTP {status}" in row["last_error"]
    assert "invalid order: zzz" in row["last_error"]
    assert len(row["last_error"]) < 300 + 100, "a short excerpt of the body, not all of it"
    assert len(server.requests) == 1


async def test_server_error_is_retried_then_delivered(db_dsn: str, server: WebhookServer) -> None:
    [event] = make_events("orders", 1)
    write_events(db_dsn, [event])
    server.answer(503, times=2, body=b"warming up")
    async with running_relay(db_dsn, _publisher(server)) as relay:
        await wait_for(lambda: count(db_dsn) == 0, what="delivered")
    assert server.received_ids() == [str(event.event_id)] * 3
    assert relay.stats.retried == 2
    assert "HTTP 503: warming up" in (relay.stats.last_error or "")


async def test_retry_after_holds_the_next_request_back(db_dsn: str, server: WebhookServer) -> None:
    events = make_events("orders", 2)
    write_events(db_dsn, events[:1])
    server.answer(429, headers={"Retry-After": "2"})
    async with running_relay(db_dsn, _publisher(server), retry_base=0.05, retry_cap=0.1) as relay:
        await wait_for(lambda: len(server.requests) >= 1, what="the first request")
        write_events(db_dsn, events[1:])  # a second event for the same origin meanwhile
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="delivered after the wait")
    first, *later = server.requests
    gap = min(r.at for r in later) - first.at
    assert gap >= 1.9, f"next request {gap:.2f}s after a Retry-After: 2"
    assert sorted(server.received_ids()[1:]) == sorted(str(e.event_id) for e in events)
    assert "Retry-After 2s" in (relay.stats.last_error or "")


async def test_retry_after_longer_than_the_wait_budget_is_not_sent_and_says_so(
    server: WebhookServer,
) -> None:
    server.answer(503, headers={"Retry-After": "120"})
    publisher = _publisher(server, max_retry_after_wait="1")
    await publisher.start()
    try:
        message = _message()
        [first] = await publisher.publish_batch([message])
        [second] = await publisher.publish_batch([message])
    finally:
        await publisher.close()
    assert first.retryable and "Retry-After 120s" in (first.error or "")
    assert second.retryable and "not sent" in (second.error or "")
    assert "Retry-After" in (second.error or "")
    assert len(server.requests) == 1, "nothing sent to the origin before Retry-After"


def _message() -> OutboundMessage:
    [event] = make_events("orders", 1)
    return OutboundMessage(
        event_id=event.event_id,
        topic=event.topic,
        key=event.key,
        event_type=event.event_type,
        aggregate_type=event.aggregate_type,
        aggregate_id=event.aggregate_id,
        payload=event.payload,
        headers=event.headers,
        created_at=dt.datetime.now(dt.UTC),
    )


async def test_a_long_retry_after_schedules_the_next_try_instead_of_burning_attempts(
    db_dsn: str, server: WebhookServer
) -> None:
    write_events(db_dsn, make_events("orders", 1))
    server.answer(503, headers={"Retry-After": "120"})
    publisher = _publisher(server, max_retry_after_wait="1")
    async with running_relay(db_dsn, publisher, retry_base=0.05, retry_cap=0.1, max_attempts=3):
        await wait_for(lambda: count(db_dsn, "last_error IS NOT NULL") == 1, what="a failure")
        await asyncio.sleep(1.0)  # backoff alone would have retried many times by now
    [row] = rows(db_dsn)
    assert row["attempts"] == 1, "one request, one attempt: the wait is not spent retrying"
    assert row["status"] == 0, "still pending, not dead-lettered"
    wait = (row["available_at"] - dt.datetime.now(dt.UTC)).total_seconds()
    assert 100 < wait <= 120, f"next try scheduled after the Retry-After, not in {wait:.0f}s"
    assert len(server.requests) == 1
