"""The RabbitMQ publisher against the machine's RabbitMQ, through the real relay.

Every test declares its own exchange and queues (unique names) and deletes them after.
The delivery guarantees every broker shares (a relay killed after publishing, the connection
cut mid-stream, an event carried whole) are in tests/integration/brokers/.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import pytest

from outboxkit import Event
from outboxkit.publishers.rabbitmq import RabbitMQPublisher
from tests.support.local_brokers import rabbitmq_url
from tests.support.relaying import (
    count,
    make_events,
    rows,
    running_relay,
    wait_for,
    write_events,
)
from tests.support.servers import unique_name


class Rabbit:
    """One test's exchange on the shared broker, and queues bound to it to read back."""

    def __init__(self, url: str, channel: aio_pika.abc.AbstractChannel) -> None:
        self.url = url
        self.channel = channel
        self.exchange = unique_name("outboxkit-test")
        self.queues: list[aio_pika.abc.AbstractQueue] = []

    def broker_url(self, *, port: int | None = None, **options: str) -> str:
        parts = urlsplit(self.url)
        netloc = parts.netloc if port is None else f"{parts.netloc.rsplit(':', 1)[0]}:{port}"
        query = "&".join(f"{k}={v}" for k, v in {"exchange": self.exchange, **options}.items())
        return f"{parts.scheme}://{netloc}{parts.path or '/'}?{query}"

    async def bind(self, routing_pattern: str = "#") -> aio_pika.abc.AbstractQueue:
        await self.channel.declare_exchange(self.exchange, "topic", durable=True)
        queue = await self.channel.declare_queue(unique_name("outboxkit-test-q"), durable=True)
        self.queues.append(queue)
        await queue.bind(self.exchange, routing_pattern)
        return queue

    async def read(
        self, queue: aio_pika.abc.AbstractQueue, n: int, timeout: float = 20.0
    ) -> list[aio_pika.abc.AbstractIncomingMessage]:
        """Up to `n` messages (fewer on timeout), then whatever else is already queued."""
        deadline = time.monotonic() + timeout
        got: list[aio_pika.abc.AbstractIncomingMessage] = []
        while time.monotonic() < deadline:
            message = await queue.get(no_ack=True, fail=False)
            if message is not None:
                got.append(message)
            elif len(got) >= n:
                break
            else:
                await asyncio.sleep(0.05)
        return got

    async def depth(self, queue: aio_pika.abc.AbstractQueue) -> int:
        declared = await self.channel.declare_queue(queue.name, passive=True)
        return declared.declaration_result.message_count or 0


@pytest.fixture
async def rabbit() -> AsyncIterator[Rabbit]:
    url = rabbitmq_url()
    connection = await aio_pika.connect(url, timeout=10)
    channel = await connection.channel()
    helper = Rabbit(url, channel)
    try:
        yield helper
    finally:
        for queue in helper.queues:
            await queue.delete(if_unused=False, if_empty=False)
        await channel.exchange_delete(helper.exchange)
        await connection.close()


def _ids(messages: list[Any]) -> list[str]:
    return [m.headers["idempotency-key"] for m in messages]


async def test_headers_forged_in_a_row_written_around_event_do_not_reach_rabbitmq(
    db_dsn: str, rabbit: Rabbit
) -> None:
    # (What every event carries, properties included: tests/integration/brokers/.)
    queue = await rabbit.bind("orders.#")
    forger = Event(
        topic="orders.placed",
        event_type="order.forged",
        payload=b"\x00\xffraw",
        headers={"x-app": "1"},
    )
    # Event() refuses reserved names; a row written around it reaches the relay, and the
    # publisher dead-letters it by Event()'s rules (issue 26), never sends it; its honest
    # neighbour arrives.
    forged = Event(topic="orders.placed", event_type="order.forged", payload=b"x")
    forged.headers.update({"idempotency-key": "forged", "cloudEvents_id": "forged"})
    write_events(db_dsn, [forger, forged])
    async with running_relay(db_dsn, RabbitMQPublisher.from_url(rabbit.broker_url())):
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="outbox settled")
    [dead] = rows(db_dsn, "status = 2")
    assert dead["event_id"] == forged.event_id
    assert "is reserved by outboxkit" in dead["last_error"]
    [m] = await rabbit.read(queue, 1)
    assert m.message_id == str(forger.event_id)
    assert m.body == forger.payload
    assert m.content_type == "application/octet-stream"
    assert m.headers["idempotency-key"] == str(forger.event_id)
    assert m.headers["cloudEvents_id"] == str(forger.event_id)
    assert m.headers["x-app"] == "1"
    assert "cloudEvents_subject" not in m.headers


async def test_unroutable_event_is_retried_with_a_clear_error_until_a_queue_is_bound(
    db_dsn: str, rabbit: Rabbit
) -> None:
    event = Event(topic="invoices.paid", event_type="invoice.paid", payload={"n": 1})
    write_events(db_dsn, [event])
    publisher = RabbitMQPublisher.from_url(rabbit.broker_url(timeout="5"))
    async with running_relay(db_dsn, publisher, retry_base=0.2, retry_cap=0.5, max_attempts=100):
        await wait_for(
            lambda: count(db_dsn, "attempts >= 2 AND last_error IS NOT NULL") == 1,
            what="a retried, unroutable event",
        )
        [row] = rows(db_dsn)
        assert row["status"] == 0, "pending: retried, not dead-lettered"
        assert "unroutable" in row["last_error"]
        assert repr(rabbit.exchange) in row["last_error"]
        assert "'invoices.paid'" in row["last_error"]
        queue = await rabbit.bind("invoices.*")
        await wait_for(lambda: count(db_dsn) == 0, what="delivered once a queue is bound")
    [message] = await rabbit.read(queue, 1)
    assert message.message_id == str(event.event_id)


async def test_headers_over_frame_max_are_dead_lettered_alone_before_breaking_the_connection(
    db_dsn: str, rabbit: Rabbit
) -> None:
    # A content header frame cannot be split: over frame_max (128 KiB by default) the
    # broker closes the whole connection, failing every publish in flight on it.
    queue = await rabbit.bind()
    healthy = make_events("orders.placed", 20)
    heavy = Event(
        topic="orders.placed",
        event_type="order.annotated",
        payload={"n": 1},
        headers={f"x-note-{i}": "n" * 8000 for i in range(20)},
    )
    write_events(db_dsn, [*healthy[:10], heavy, *healthy[10:]])
    publisher = RabbitMQPublisher.from_url(rabbit.broker_url())
    async with running_relay(db_dsn, publisher) as relay:
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="all settled")
    [dead] = rows(db_dsn)
    assert dead["event_id"] == heavy.event_id
    assert (dead["status"], dead["attempts"]) == (2, 1), "dead-lettered at once"
    assert "frame_max" in dead["last_error"] and "131 072" in dead["last_error"]
    assert relay.stats.released == 0, "no connection lost, nothing handed back"
    got = await rabbit.read(queue, len(healthy))
    assert sorted(m.message_id for m in got) == sorted(str(e.event_id) for e in healthy)
