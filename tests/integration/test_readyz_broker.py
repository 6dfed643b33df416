"""/readyz follows the broker's reachability within seconds, as the broker's client reports it.

Before (issue 12) it stayed 200 until a publish timed out (0.8 x lease), and an idle
relay never noticed at all. Each test runs a real relay in this process with its metrics
server on a free port, in front of a real broker reached through a TcpProxy that the test
cuts and restores; it polls /readyz as a load balancer would: 503 within 5 s of the cut,
200 within 10 s of the restore, and a reason that names no host, port or credential.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import pytest
from aiohttp import web

from outboxkit import Event
from outboxkit.ops.http import metrics_app, serving
from outboxkit.ops.metrics import RelayMetrics
from outboxkit.publishers.base import Publisher, Reachability, restored_since, unreachable
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.publishers.rabbitmq import RabbitMQPublisher
from outboxkit.publishers.redis import RedisStreamsPublisher
from outboxkit.publishers.webhook import WebhookPublisher
from outboxkit.testing import free_port, spawn_relay
from tests.support.local_brokers import rabbitmq_url, redis_url
from tests.support.moto_sqs import MotoSqs, running_moto
from tests.support.relaying import count, running_relay, wait_for, write_events
from tests.support.servers import consume_kafka, ensure_stream, unique_name

DOWN_WITHIN = 5.0  # seconds from the cut to /readyz 503
UP_WITHIN = 10.0  # seconds from the restore to /readyz 200


@contextlib.asynccontextmanager
async def _relay_serving_readyz(
    dsn: str, publisher: Publisher, **options: Any
) -> AsyncIterator[str]:
    """A relay with its /metrics /healthz /readyz app on a free port; yields the /readyz URL."""
    metrics = RelayMetrics(dsn, gauge_interval=0.3, process_metrics=False)
    port = free_port()
    async with running_relay(dsn, publisher, observer=metrics, lease=30.0, **options) as relay:
        metrics.attach(relay)
        async with serving(metrics_app(metrics), "127.0.0.1", port):
            gauges = asyncio.create_task(metrics.run_gauges())
            try:
                yield f"http://127.0.0.1:{port}/readyz"
            finally:
                gauges.cancel()
                await asyncio.gather(gauges, return_exceptions=True)


async def _readyz(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def _until(url: str, status: int, timeout: float) -> tuple[float, str]:
    """Seconds until /readyz answers ``status`` (polled every 0.1 s), and that body."""
    started = time.monotonic()
    while True:
        got, body = await _readyz(url)
        elapsed = time.monotonic() - started
        if got == status:
            return elapsed, body
        if elapsed > timeout:
            raise AssertionError(
                f"/readyz still {got} after {elapsed:.1f}s (want {status}): {body}"
            )
        await asyncio.sleep(0.1)


async def _outage(
    url: str,
    cut: Callable[[], Any],
    restore: Callable[[], Any],
    secrets: set[str],
    *,
    during: Callable[[], Any] | None = None,
) -> tuple[float, float]:
    """Cut, measure the 503, restore, measure the 200; check the reason on the way."""
    await _until(url, 200, 30.0)
    cut()
    down, body = await _until(url, 503, 15.0)
    assert body.startswith("not ready: broker unreachable for "), body
    leaked = {s for s in secrets if s and s.lower() in body.lower()}
    assert not leaked, f"/readyz names {leaked}: {body}"
    if during is not None:
        during()
    await asyncio.sleep(1.0)
    status, body = await _readyz(url)
    assert status == 503, f"ready again while the broker is still cut: {body}"
    restore()
    up, _ = await _until(url, 200, 20.0)
    assert down <= DOWN_WITHIN, f"/readyz took {down:.1f}s to turn 503 (at most {DOWN_WITHIN}s)"
    assert up <= UP_WITHIN, f"/readyz took {up:.1f}s to turn 200 again (at most {UP_WITHIN}s)"
    return down, up


def _events(topic: str, n: int) -> list[Event]:
    return [Event(topic=topic, event_type="t", key=f"k{i}", payload={"i": i}) for i in range(n)]


def _secrets(*urls: str) -> set[str]:
    found = {"127.0.0.1", "localhost", "://"}
    for url in urls:
        parts = urllib.parse.urlsplit(url if "://" in url else f"x://{url}")
        found |= {str(parts.port), parts.username or "", parts.password or ""}
    return {s for s in found if s and s != "None"}


# ------------------------------------------------------------------------------- NATS


async def test_nats_idle_relay_readyz_follows_a_cut_link_both_ways(
    db_dsn: str, nats_server: Any, proxy_factory: Any
) -> None:
    """No event flows: only the client's disconnected/closed callbacks can say it."""
    root = unique_name("rz").replace("-", "")
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    target = urllib.parse.urlsplit(nats_server.url)
    assert target.port is not None
    proxy = proxy_factory("127.0.0.1", target.port)
    broker = f"nats://127.0.0.1:{proxy.port}?timeout=2"
    publisher = NatsPublisher.from_url(broker)
    async with _relay_serving_readyz(db_dsn, publisher) as url:
        write_events(db_dsn, _events(f"{root}.a", 5))
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="published")
        down, up = await _outage(
            url, proxy.cut, proxy.resume, _secrets(broker, nats_server.url, db_dsn)
        )
        # and twice: the publisher reconnected by itself, it can lose the broker again
        await _outage(url, proxy.cut, proxy.resume, _secrets(broker, nats_server.url, db_dsn))
    print(f"nats: 503 after {down:.2f}s, 200 after {up:.2f}s")


async def test_nats_relay_process_readyz_follows_a_cut_link_both_ways(
    db_dsn: str, nats_server: Any, proxy_factory: Any, tmp_path: Path
) -> None:
    """The same through `outboxkit relay --metrics-port` (the CLI wires the publisher in)."""
    root = unique_name("rz").replace("-", "")
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    target = urllib.parse.urlsplit(nats_server.url)
    assert target.port is not None
    proxy = proxy_factory("127.0.0.1", target.port)
    broker = f"nats://127.0.0.1:{proxy.port}?timeout=2"
    port = free_port()
    log_path = tmp_path / "relay.log"
    relay = spawn_relay(
        db_dsn, broker, log_path, "--metrics-port", str(port), "--poll-interval", "0.2"
    )
    try:
        url = f"http://127.0.0.1:{port}/readyz"
        await wait_for(_answers(url), timeout=30, what="the relay's /readyz")
        write_events(db_dsn, _events(f"{root}.a", 3))
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="published")
        down, up = await _outage(url, proxy.cut, proxy.resume, _secrets(broker, db_dsn))
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(30)
    log = log_path.read_text()
    assert code == 0, log[-3000:]
    assert "not ready: broker unreachable" in log, "the reason is logged once"
    print(f"nats (relay process): 503 after {down:.2f}s, 200 after {up:.2f}s")


def _answers(url: str) -> Callable[[], Any]:
    async def check() -> bool:
        try:
            await _readyz(url)
        except aiohttp.ClientError:
            return False
        return True

    return check


async def test_nats_events_written_during_the_cut_are_published_and_readyz_recovers(
    db_dsn: str, nats_server: Any, proxy_factory: Any
) -> None:
    root = unique_name("rz").replace("-", "")
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    target = urllib.parse.urlsplit(nats_server.url)
    assert target.port is not None
    proxy = proxy_factory("127.0.0.1", target.port)
    broker = f"nats://127.0.0.1:{proxy.port}?timeout=1"
    async with _relay_serving_readyz(db_dsn, NatsPublisher.from_url(broker)) as url:
        write_events(db_dsn, _events(f"{root}.a", 5))
        await _outage(
            url,
            proxy.cut,
            proxy.resume,
            _secrets(broker, db_dsn),
            during=lambda: write_events(db_dsn, _events(f"{root}.b", 20)),
        )
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="the backlog published")
        assert count(db_dsn, "status = 2") == 0


# ------------------------------------------------------------------------------ Kafka


async def test_kafka_readyz_follows_all_brokers_down_and_back(
    db_dsn: str, kafka_behind_proxy: Any
) -> None:
    """librdkafka says _ALL_BROKERS_DOWN at once; nothing when they return (a probe does)."""
    topic = unique_name("rz")
    proxy = kafka_behind_proxy.proxy
    publisher = KafkaPublisher.from_url(kafka_behind_proxy.url)
    async with _relay_serving_readyz(db_dsn, publisher) as url:
        write_events(db_dsn, _events(topic, 5))
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="published")
        down, up = await _outage(
            url,
            proxy.cut,
            proxy.resume,
            _secrets(kafka_behind_proxy.url, str(kafka_behind_proxy.broker.port), db_dsn),
            during=lambda: write_events(db_dsn, _events(topic, 10)),
        )
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the backlog published")
    assert len(consume_kafka(kafka_behind_proxy.bootstrap, topic, 15, 15.0)) >= 15
    print(f"kafka: 503 after {down:.2f}s, 200 after {up:.2f}s")


# --------------------------------------------------------------------------- RabbitMQ


@pytest.fixture
async def rabbit_exchange() -> AsyncIterator[tuple[str, str]]:
    """(url of the machine's RabbitMQ, an exchange of this test's own with a bound queue)."""
    url = rabbitmq_url()
    exchange = unique_name("outboxkit-rz")
    connection = await aio_pika.connect(url, timeout=10)
    channel = await connection.channel()
    await channel.declare_exchange(exchange, "topic", durable=True)
    queue = await channel.declare_queue(unique_name("outboxkit-rz-q"), durable=True)
    await queue.bind(exchange, "#")
    try:
        yield url, exchange
    finally:
        await queue.delete(if_unused=False, if_empty=False)
        await channel.exchange_delete(exchange)
        await connection.close()


async def test_rabbitmq_idle_relay_readyz_follows_a_cut_link_both_ways(
    db_dsn: str, rabbit_exchange: tuple[str, str], proxy_factory: Any
) -> None:
    """The machine's RabbitMQ keeps running: only the relay's link to it is cut."""
    url, exchange = rabbit_exchange
    parts = urllib.parse.urlsplit(url)
    proxy = proxy_factory(parts.hostname or "127.0.0.1", parts.port or 5672)
    netloc = f"{parts.username}:{parts.password}@127.0.0.1:{proxy.port}"
    broker = f"amqp://{netloc}{parts.path or '/'}?exchange={exchange}"
    async with _relay_serving_readyz(db_dsn, RabbitMQPublisher.from_url(broker)) as ready:
        write_events(db_dsn, _events("orders.created", 5))
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="published")
        down, up = await _outage(
            ready,
            proxy.cut,
            proxy.resume,
            _secrets(broker, url, db_dsn) | {"guest", "amqp://"},
            during=lambda: write_events(db_dsn, _events("orders.created", 10)),
        )
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="the backlog published")
        assert count(db_dsn, "status = 2") == 0
    print(f"rabbitmq: 503 after {down:.2f}s, 200 after {up:.2f}s")


# ------------------------------------------------------------------------------ Redis


async def test_redis_failed_connects_turn_readyz_503_and_a_reply_turns_it_200(
    db_dsn: str, proxy_factory: Any
) -> None:
    """redis-py has no connection events: round trips that cannot connect for 2 s say it."""
    import redis.asyncio

    url = redis_url()
    parts = urllib.parse.urlsplit(url)
    proxy = proxy_factory(parts.hostname or "127.0.0.1", parts.port or 6379)
    prefix = f"{unique_name('rz')}:"
    broker = f"redis://127.0.0.1:{proxy.port}{parts.path or '/0'}?stream_prefix={prefix}&timeout=2"
    publisher = RedisStreamsPublisher.from_url(broker)
    # failed round trips count attempts: slow retries, so none is dead-lettered meanwhile
    options = {"retry_base": 0.5, "retry_cap": 1.0, "max_attempts": 100}
    async with _relay_serving_readyz(db_dsn, publisher, **options) as ready:
        write_events(db_dsn, _events("orders", 5))
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="published")
        await _until(ready, 200, 30.0)
        proxy.cut()
        write_events(db_dsn, _events("orders", 10))  # only a round trip can find out
        down, body = await _until(ready, 503, 15.0)
        assert body.startswith("not ready: broker "), body
        await asyncio.sleep(2.5)
        status, body = await _readyz(ready)
        assert status == 503 and body.startswith("not ready: broker unreachable for "), body
        assert not {s for s in _secrets(broker, url) if s.lower() in body.lower()}, body
        proxy.resume()
        up, _ = await _until(ready, 200, 20.0)
        await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="the backlog published")
    client = redis.asyncio.from_url(url)
    try:
        assert await client.xlen(f"{prefix}orders") >= 15
        await client.delete(f"{prefix}orders")
    finally:
        await client.aclose()
    assert down <= DOWN_WITHIN, f"{down:.1f}s"
    assert up <= UP_WITHIN, f"{up:.1f}s"


# -------------------------------------------------------------------------------- SQS


def _aws_destination(moto: MotoSqs, scheme: str) -> str:
    """A fresh SQS queue, SNS topic, Kinesis stream or EventBridge bus on ``moto``; its URL."""
    name = f"rz-{scheme}"
    if scheme == "sqs":
        moto.create_queue(name)
    elif scheme == "sns":
        moto.client("sns").create_topic(Name=name)
    elif scheme == "kinesis":
        moto.create_stream(name, shards=1)
    else:
        moto.client("events").create_event_bus(Name=name)
    return moto.url(name, timeout="2").replace("sqs://", f"{scheme}://", 1)


@pytest.mark.parametrize("scheme", ["sqs", "sns", "kinesis", "eventbridge"])
async def test_aws_endpoint_down_turns_readyz_503_and_back_200(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """boto3 has no connection events: EndpointConnectionError for 2 s with no answer says it."""
    from outboxkit.publishers import from_url

    with running_moto(monkeypatch) as moto:
        broker = _aws_destination(moto, scheme)
        options = {"retry_base": 0.5, "retry_cap": 1.0, "max_attempts": 100}
        async with _relay_serving_readyz(db_dsn, from_url(broker), **options) as url:
            write_events(db_dsn, _events("orders", 3))
            await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="published")
            await _until(url, 200, 30.0)
            moto.stop()
            write_events(db_dsn, _events("orders", 5))
            down, body = await _until(url, 503, 15.0)
            await asyncio.sleep(2.5)
            status, body = await _readyz(url)
            assert status == 503 and body.startswith("not ready: broker unreachable for "), body
            assert "EndpointConnectionError" in body and str(moto.port) not in body, body
            moto.start()
            up, _ = await _until(url, 200, 20.0)
            await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="the backlog published")
    assert down <= DOWN_WITHIN, f"{down:.1f}s"
    assert up <= UP_WITHIN, f"{up:.1f}s"


# --------------------------------------------------------------------------- webhooks


async def test_webhook_refused_connections_turn_readyz_503_until_a_receiver_answers(
    db_dsn: str,
) -> None:
    """HTTP has no connection events: refused connects with no answer for 2 s make it 503."""
    port = free_port()  # nothing listens yet: every POST is refused
    target = f"http://127.0.0.1:{port}/hooks/{{topic}}"
    publisher = WebhookPublisher(target, timeout=2)
    received: list[bytes] = []

    async def hook(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(status=204)

    # refused POSTs count attempts: slow retries, so none is dead-lettered meanwhile
    options = {"retry_base": 0.5, "retry_cap": 1.0, "max_attempts": 100}
    async with _relay_serving_readyz(db_dsn, publisher, **options) as url:
        await _until(url, 200, 30.0)
        write_events(db_dsn, _events("orders", 3))
        down, body = await _until(url, 503, 15.0)
        # the failed batch may say it first ("not confirming"); either names no address
        assert body.startswith("not ready: broker "), body
        assert str(port) not in body and "127.0.0.1" not in body, body
        await asyncio.sleep(2.5)  # refused for longer than Reachability.grace: unreachable
        status, body = await _readyz(url)
        assert status == 503 and body.startswith("not ready: broker unreachable for "), body
        assert "ConnectError" in body and str(port) not in body, body
        app = web.Application()
        app.router.add_post("/hooks/{topic}", hook)
        async with serving(app, "127.0.0.1", port, what="test receiver"):
            up, _ = await _until(url, 200, 20.0)
            await wait_for(lambda: count(db_dsn) == 0, timeout=20, what="delivered")
    assert len(received) == 3
    assert down <= DOWN_WITHIN, f"{down:.1f}s"
    assert up <= UP_WITHIN, f"{up:.1f}s"


# ----------------------------------------------------------------- the state itself


def test_reachability_grace_forgetting_and_restored_at() -> None:
    """Pure unit (a clock of its own): what each publisher feeds and /readyz reads."""
    now = [100.0]
    reach = Reachability(grace=2.0, forget_after=60.0, clock=lambda: now[0])
    publisher = type("P", (), {"reachability": reach})()
    reach.failed("ConnectError")
    now[0] += 1.9
    assert unreachable(publisher) is None, "one refused request is not an outage yet"
    now[0] += 0.2
    assert unreachable(publisher) == pytest.approx((2.1, "ConnectError"))
    reach.succeeded()
    assert unreachable(publisher) is None and restored_since(publisher, 100.0)
    reach.failed("ConnectError")
    now[0] += 61.0  # nothing tried since (idle): the failure is forgotten
    assert unreachable(publisher) is None
    reach.lost("disconnected")  # the client says so: no grace
    assert unreachable(publisher) == (0.0, "disconnected")
    assert unreachable(object()) is None, "a publisher without reachability is never reported"
    assert not restored_since(object(), 0.0)
