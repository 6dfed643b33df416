"""What a hostile or broken webhook receiver, or a hostile event, could do to the relay: closed.

Each attack runs against a real HTTP server on loopback: a body that never ends, a
``Retry-After`` no timestamp can hold, and ``.``/``..`` in a templated URL.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.publishers.webhook import WebhookPublisher
from tests.support.relaying import count, make_events, rows, running_relay, wait_for, write_events
from tests.support.webhook_server import WebhookServer

_CHUNK = b"x" * 65536


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    hooks = WebhookServer()
    hooks.start()
    yield hooks
    hooks.stop()


def _message(topic: str = "orders", key: str | None = "acme") -> OutboundMessage:
    return OutboundMessage(
        event_id=uuid.uuid4(),
        topic=topic,
        key=key,
        event_type="order.placed",
        aggregate_type="order",
        aggregate_id="1",
        payload=b'{"total": 1}',
        headers={},
        created_at=dt.datetime.now(dt.UTC),
    )


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class _EndlessBody:
    """A receiver that answers `status` with a chunked body it streams until the client leaves."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.sent = 0  # body bytes written to the socket, across connections
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._stream, args=(conn,), daemon=True).start()

    def _stream(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                data = conn.recv(65536)
                if not data:
                    return
                request += data
            head = (
                f"HTTP/1.1 {self.status} Whatever\r\ncontent-type: text/plain\r\n"
                "transfer-encoding: chunked\r\n\r\n"
            )
            chunk = f"{len(_CHUNK):x}\r\n".encode() + _CHUNK + b"\r\n"
            try:
                conn.sendall(head.encode())
                while not self._stop.is_set():
                    conn.sendall(chunk)
                    self.sent += len(_CHUNK)
            except OSError:
                return  # the client hung up: what a bounded reader does

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


@pytest.mark.parametrize("status", [500, 200])
async def test_a_response_body_that_never_ends_is_read_only_up_to_a_small_cap(
    status: int,
) -> None:
    """Before: the whole body was read into memory; 2 GB of RSS in 5 s and no verdict ever.

    httpx's read timeout applies to each read, so a receiver that keeps streaming never
    times out. Now at most 64 KiB is read, within the timeout, then the connection is closed.
    """
    receiver = _EndlessBody(status)
    publisher = WebhookPublisher(f"http://127.0.0.1:{receiver.port}/hooks", timeout=2.0)
    rss_before = _rss_bytes()
    started = time.monotonic()
    try:
        [result] = await asyncio.wait_for(publisher.publish_batch([_message()]), timeout=10)
    finally:
        await publisher.close()
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.2)
        receiver.close()
    grown = _rss_bytes() - rss_before
    if status == 200:
        assert result.ok, result
    else:
        assert not result.ok and result.retryable and result.error_class == "http_500"
        assert "xxxx" in (result.error or ""), "the excerpt still shows the body's start"
    assert elapsed < 3.0, f"the verdict took {elapsed:.1f}s"
    # What the receiver could push is the capped read plus the loopback socket buffers.
    assert receiver.sent < 32 * 2**20, f"the receiver wrote {receiver.sent / 2**20:.0f} MiB"
    assert grown < 32 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


async def test_an_absurd_retry_after_is_capped_and_the_settle_still_succeeds(
    db_dsn: str, server: WebhookServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: `Retry-After: 99999999999999999999` made every settle of the row fail with
    DatetimeFieldOverflow: attempts climbed on each lease expiry, last_error never written.
    Now a receiver's Retry-After counts up to one hour (the default cap)."""
    caplog.set_level(logging.ERROR)
    write_events(db_dsn, make_events("orders", 1))
    server.answer(503, headers={"Retry-After": "99999999999999999999"})
    publisher = WebhookPublisher.from_url(server.url() + "?timeout=2")
    async with running_relay(db_dsn, publisher):
        await wait_for(lambda: count(db_dsn, "last_error IS NOT NULL") == 1, what="the settle")
    [row] = rows(db_dsn)
    wait = (row["available_at"] - dt.datetime.now(dt.UTC)).total_seconds()
    assert 3500 < wait <= 3600, f"next try in {wait:.0f}s, not after the 1 h cap"
    assert (row["attempts"], row["status"]) == (1, 0)
    assert "HTTP 503" in row["last_error"]
    assert not [r for r in caplog.records if "settle failed" in r.getMessage()]


async def test_a_retry_after_date_far_in_the_future_is_capped_by_the_url_option(
    db_dsn: str, server: WebhookServer
) -> None:
    write_events(db_dsn, make_events("orders", 1))
    server.answer(429, headers={"Retry-After": "Fri, 31 Dec 9999 23:59:59 GMT"})
    publisher = WebhookPublisher.from_url(server.url() + "?timeout=2&max_retry_after=60")
    async with running_relay(db_dsn, publisher):
        await wait_for(lambda: count(db_dsn, "last_error IS NOT NULL") == 1, what="the settle")
    [row] = rows(db_dsn)
    wait = (row["available_at"] - dt.datetime.now(dt.UTC)).total_seconds()
    assert 50 < wait <= 60, f"next try in {wait:.0f}s, not after the 60 s cap"
    assert "max_retry_after" not in server.requests[0].path, "an option, not sent on"


class _AskingForever:
    """A publisher (any third-party one) whose retry_after no timestamp can hold."""

    name = "asking-forever"

    def __init__(self) -> None:
        self.delays = [1e20, math.inf, math.nan, -5.0]
        self.given: dict[uuid.UUID, float] = {}  # an event keeps its delay when it comes back

    def _delay(self, message: OutboundMessage) -> float:
        return self.given.setdefault(
            message.event_id, self.delays[len(self.given) % len(self.delays)]
        )

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        return [PublishResult.retry("busy", retry_after=self._delay(m)) for m in messages]


async def test_the_settle_bounds_any_publishers_retry_after(db_dsn: str) -> None:
    write_events(db_dsn, make_events("orders", 4))
    async with running_relay(db_dsn, _AskingForever()) as relay:
        await wait_for(lambda: count(db_dsn, "last_error IS NOT NULL") == 4, what="the settle")
    # NaN and negative delays add no wait, so those rows may come back before the relay stops
    assert relay.stats.retried >= 4
    now = dt.datetime.now(dt.UTC)
    waits = sorted((r["available_at"] - now).total_seconds() for r in rows(db_dsn))
    assert waits[-1] <= 30 * 86400, "bounded: at most 30 days"
    assert waits[-1] > 29 * 86400, "1e20 and inf wait the longest the settle allows"
    assert waits[0] < 5, "NaN and negative delays mean no extra wait"


async def test_dot_segments_in_templated_values_are_refused(server: WebhookServer) -> None:
    """Before: key `..` in `/tenants/{key}/hooks/{topic}` made the request `/hooks/admin`.

    The HTTP client resolves dot segments (RFC 3986), so the receiver sees another path;
    receivers that decode `%2e` before resolving do the same with the encoded forms.
    """
    async with httpx.AsyncClient() as client:  # the mechanism, against the same server
        await client.post(server.url("/tenants/../hooks/admin"), content=b"{}")
    assert server.requests[-1].path == "/hooks/admin"
    server.requests.clear()

    publisher = WebhookPublisher(server.url("/tenants/{key}/hooks/{topic}"), timeout=2.0)
    hostile = [
        _message("admin", ".."),
        _message("admin", "."),
        _message("admin", "%2e%2e"),
        _message("admin", "%2E%2e"),
        _message("admin", "%252e%252e"),
        _message("admin", "../admin"),
        _message("admin", "..%2Fadmin"),
        _message("..", "acme"),
    ]
    try:
        results = await publisher.publish_batch([*hostile, _message("orders", "acme.eu")])
    finally:
        await publisher.close()
    *refused, fine = results
    assert fine.ok
    for message, result in zip(hostile, refused, strict=True):
        assert not result.ok and not result.retryable, (message.key, result)
        assert "path segment" in (result.error or ""), result.error
    assert [r.path for r in server.requests] == ["/tenants/acme.eu/hooks/orders"]


def test_max_retry_after_must_be_sane() -> None:
    with pytest.raises(ConfigurationError, match="max_retry_after"):
        WebhookPublisher("http://127.0.0.1:1/hooks", max_retry_after=0)
    with pytest.raises(ConfigurationError, match="at most 30 days"):
        WebhookPublisher.from_url("http://127.0.0.1:1/hooks?max_retry_after=1e9")
