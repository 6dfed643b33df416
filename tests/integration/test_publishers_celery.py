"""The celery+ publishers' own failures: a queue declared otherwise, an event not a task."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aio_pika
import pytest

from outboxkit import Event
from outboxkit.contrib.celery import task_event
from outboxkit.publishers import from_url
from tests.support.celery_worker import as_outbound
from tests.support.local_brokers import rabbitmq_url
from tests.support.servers import unique_name


@pytest.fixture
async def priority_queue() -> AsyncIterator[str]:
    """A queue declared with x-max-priority (as a worker with task_queue_max_priority does)."""
    url = rabbitmq_url()
    queue = unique_name("okit_celery_prio")
    connection = await aio_pika.connect(url)
    channel = await connection.channel()
    exchange = await channel.declare_exchange(queue, aio_pika.ExchangeType.DIRECT, durable=True)
    declared = await channel.declare_queue(queue, durable=True, arguments={"x-max-priority": 10})
    await declared.bind(exchange, routing_key=queue)
    try:
        yield queue
    finally:
        await channel.queue_delete(queue)
        await channel.exchange_delete(queue)
        await connection.close()


async def test_a_queue_declared_otherwise_is_retried_with_what_to_do_and_declare_false_sends(
    priority_queue: str,
) -> None:
    message = as_outbound(task_event("proj.add", (1, 2), queue=priority_queue))
    base = rabbitmq_url().rstrip("/") + "//"
    publisher = from_url(f"celery+{base}")
    await publisher.start()
    try:
        [refused] = await publisher.publish_batch([message])
        assert refused.retryable and refused.error_class == "declare_failed"
        assert refused.error is not None and "declare=false" in refused.error
        assert "guest:guest" not in refused.error
    finally:
        await publisher.close()
    publisher = from_url(f"celery+{base}?declare=false")
    await publisher.start()
    try:
        assert [r.ok for r in await publisher.publish_batch([message] * 3)] == [True] * 3
    finally:
        await publisher.close()


async def test_an_event_that_is_not_a_task_is_dead_lettered_at_once() -> None:
    other = as_outbound(Event(topic="celery", event_type="order.placed", payload={"id": 1}))
    publisher = from_url(f"celery+{rabbitmq_url().rstrip('/')}//?allow=okit_none")
    try:
        [result] = await publisher.publish_batch([other])
    finally:
        await publisher.close()
    assert not result.retryable and result.error_class == "not_a_task"
    assert result.error is not None and "outbox= of its own" in result.error


async def test_a_queue_outside_allow_is_refused_and_never_declared() -> None:
    base = rabbitmq_url().rstrip("/") + "//"
    queue = unique_name("okit_celery_denied")
    publisher = from_url(f"celery+{base}?allow=okit_celery_allowed_*")
    await publisher.start()
    try:
        [result] = await publisher.publish_batch([as_outbound(task_event("p.t", queue=queue))])
    finally:
        await publisher.close()
    assert not result.retryable and result.error_class == "not_allowed"
    connection = await aio_pika.connect(rabbitmq_url())
    try:
        channel = await connection.channel()
        with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
            await channel.declare_queue(queue, passive=True)
    finally:
        await connection.close()
