"""examples/ run as a user runs them: `python examples/<broker>_orders.py` against real servers.

Each example places orders, relays their events through its broker and invoices them
through an inbox consumer, then exits 0. The test checks the database afterwards: one
invoice per order, one inbox record per event, nothing left in the outbox.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from outboxkit import Event, Outbox, migrate
from tests.support.servers import unique_name

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TESTED = {
    "kafka_orders.py",
    "nats_orders.py",
    "rabbitmq_orders.py",
    "redis_orders.py",
    "sqs_orders.py",
    "webhook_orders.py",
}

pytestmark = pytest.mark.slow


def test_every_example_is_tested() -> None:
    programs = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert programs == TESTED, f"examples without a test, or tests without one: {programs ^ TESTED}"


@pytest.mark.exclusive  # drives the CPUs itself: alone under xdist
def test_kafka(empty_db_dsn: str, kafka_broker) -> None:
    _run("kafka_orders.py", empty_db_dsn, KAFKA_BOOTSTRAP=kafka_broker.bootstrap)


def test_nats(empty_db_dsn: str, nats_server) -> None:
    stream = unique_name("ORDERS")
    try:
        _run("nats_orders.py", empty_db_dsn, NATS_URL=nats_server.url, NATS_STREAM=stream)
    finally:
        asyncio.run(_delete_nats_stream(nats_server.url, stream))


def test_rabbitmq(empty_db_dsn: str) -> None:
    from tests.support.local_brokers import rabbitmq_url

    url, exchange, queue = rabbitmq_url(), unique_name("shop"), unique_name("billing")
    try:
        _run(
            "rabbitmq_orders.py",
            empty_db_dsn,
            RABBITMQ_URL=url,
            RABBITMQ_EXCHANGE=exchange,
            RABBITMQ_QUEUE=queue,
        )
    finally:
        asyncio.run(_delete_rabbitmq(url, exchange, queue))


def test_redis_twice_on_one_database(empty_db_dsn: str) -> None:
    """A second run sets up nothing twice and invoices only its own new orders."""
    from tests.support.local_brokers import redis_url

    url, topic = redis_url(), unique_name("orders")
    try:
        _run("redis_orders.py", empty_db_dsn, REDIS_URL=url, ORDERS_TOPIC=topic)
        _run("redis_orders.py", empty_db_dsn, REDIS_URL=url, ORDERS_TOPIC=topic, orders=6)
    finally:
        stream = f"outbox:{topic}"  # the example's stream_prefix
        asyncio.run(_delete_redis_streams(url, stream, f"{stream}:dead"))


def test_sqs(empty_db_dsn: str) -> None:
    from tests.support.moto_sqs import MotoSqs

    moto = MotoSqs()
    moto.start()
    try:
        _run(
            "sqs_orders.py",
            empty_db_dsn,
            SQS_ENDPOINT_URL=moto.endpoint,
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
        )
    finally:
        moto.stop()


def test_webhook(empty_db_dsn: str) -> None:
    _run("webhook_orders.py", empty_db_dsn)


def test_webhook_receiver_rejects_what_the_secret_did_not_sign(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The example's receiver checks the signature over the raw bytes, not just its presence."""
    from outboxkit.publishers.webhook import decode_secret, sign

    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    monkeypatch.setenv("ORDERS_HOOK_SECRET", secret)
    spec = importlib.util.spec_from_file_location("webhook_orders", EXAMPLES / "webhook_orders.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    body, event_id, timestamp = b'{"order_id": 1, "total": 4200}', "e-1", "1700000000"
    headers = {"webhook-id": event_id, "webhook-timestamp": timestamp}
    genuine = sign(decode_secret(secret), event_id, timestamp, body)
    forged = sign(b"another key", event_id, timestamp, body)
    assert example.signed({**headers, "webhook-signature": genuine}, body)
    assert example.signed({**headers, "webhook-signature": f"{forged} {genuine}"}, body)
    assert not example.signed({**headers, "webhook-signature": forged}, body)
    assert not example.signed({**headers, "webhook-signature": genuine}, body + b" ")
    assert not example.signed({**headers, "webhook-id": "e-2", "webhook-signature": genuine}, body)
    assert not example.signed(headers, body)


# -- helpers ------------------------------------------------------------------------------


def _run(example: str, dsn: str, *, orders: int = 3, **env: str) -> None:
    """Run one example to completion and check what it left in the database."""
    env.setdefault("ORDERS_TOPIC", unique_name("orders"))
    try:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / example)],
            env={**os.environ, "OUTBOXKIT_DSN": dsn, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{example} did not finish within 120 s:\n{exc.stdout}\n{exc.stderr}")
    output = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, f"{example} exited with {done.returncode}:\n{output}"
    assert "Traceback" not in output, output
    assert "invoiced" in done.stdout, output
    with psycopg.connect(dsn) as conn:
        placed = conn.execute("SELECT id, total FROM orders ORDER BY id").fetchall()
        invoiced = conn.execute("SELECT order_id, total FROM invoices ORDER BY order_id").fetchall()
        (records,) = conn.execute("SELECT count(*) FROM processed_events").fetchone() or (0,)
        (left,) = conn.execute("SELECT count(*) FROM outbox").fetchone() or (0,)
    assert len(placed) == orders
    assert invoiced == placed, "every order invoiced exactly once"
    assert records == orders, "one inbox record per event"
    assert left == 0, "the relay published (and deleted) every event"


async def _delete_nats_stream(url: str, stream: str) -> None:
    import nats

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def _delete_rabbitmq(url: str, exchange: str, queue: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(url, timeout=5)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(queue)
        await channel.exchange_delete(exchange)


async def _delete_redis_streams(url: str, *streams: str) -> None:
    import redis.asyncio as redis

    client = redis.from_url(url)
    try:
        await client.delete(*streams)
    finally:
        await client.aclose()


# -- the examples after the README's own steps, on the same servers -------------------------


def _readme_nats_relay(dsn: str, nats_url: str) -> None:
    """The README's `outboxkit relay --broker 'nats://…'` line, as written, until it published."""
    from tests.integration.test_readme import readme_blocks

    line = next(
        ln.split("#")[0]
        for b in readme_blocks()
        if b.lang == "sh"
        for ln in b.code.splitlines()
        if ln.startswith("outboxkit relay --broker") and "nats://" in ln
    )
    argv = [sys.executable, "-m", "outboxkit", *shlex.split(line)[1:]]
    argv = [re.sub(r"^nats://[^?]+", nats_url.rstrip("/"), a) for a in argv]
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:  # the README's first write, in short
        conn.execute(
            "CREATE TABLE IF NOT EXISTS orders (id serial PRIMARY KEY, customer text, total int)"
        )
        with conn.transaction():
            (order_id,) = conn.execute(
                "INSERT INTO orders (customer, total) VALUES ('ada', 4200) RETURNING id"
            ).fetchone() or (0,)
            Outbox().put(conn, Event(topic="orders", event_type="order.placed",
                                     payload={"order_id": order_id, "total": 4200}))  # fmt: skip
    relay = subprocess.Popen(
        argv, env={**os.environ, "OUTBOXKIT_DSN": dsn}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while _outbox_rows(dsn) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        relay.send_signal(signal.SIGTERM)
        output, _ = relay.communicate(timeout=30)
    assert relay.returncode == 0 and _outbox_rows(dsn) == 0, output
    assert "cannot create JetStream stream" not in output, output


def _outbox_rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        (n,) = conn.execute("SELECT count(*) FROM outbox").fetchone() or (0,)
    return int(n)


def _example(name: str, dsn: str, **env: str) -> subprocess.CompletedProcess[str]:
    """An example with the user's environment: no test-made stream or topic names."""
    base = {k: v for k, v in os.environ.items() if k not in ("NATS_STREAM", "ORDERS_TOPIC")}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        env={**base, "OUTBOXKIT_DSN": dsn, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_nats_example_runs_after_the_readme_relay_line(empty_db_dsn: str, fresh_nats) -> None:
    """Before: `nats: stream name already in use with a different configuration` traceback."""
    _readme_nats_relay(empty_db_dsn, fresh_nats.url)
    for stream in (None, "ORDERS"):  # the default, and NATS_STREAM naming the README's stream
        env = {"NATS_URL": fresh_nats.url, **({"NATS_STREAM": stream} if stream else {})}
        done = _example("nats_orders.py", empty_db_dsn, **env)
        output = done.stdout + done.stderr
        assert done.returncode == 0 and "Traceback" not in output, output
        assert "invoiced" in done.stdout, output


def test_the_readme_relay_line_runs_after_the_nats_example(empty_db_dsn: str, fresh_nats) -> None:
    done = _example("nats_orders.py", empty_db_dsn, NATS_URL=fresh_nats.url)
    assert done.returncode == 0, done.stdout + done.stderr
    _readme_nats_relay(empty_db_dsn, fresh_nats.url)


def test_a_nats_stream_clash_is_one_line(empty_db_dsn: str, fresh_nats) -> None:
    """A stream of the asked name that stores other subjects: one line saying what to do."""
    _readme_nats_relay(empty_db_dsn, fresh_nats.url)  # ORDERS stores orders, orders.>
    done = _example(
        "nats_orders.py", empty_db_dsn,
        NATS_URL=fresh_nats.url, NATS_STREAM="ORDERS", ORDERS_TOPIC="invoices",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.splitlines()
    assert "cannot create NATS stream 'ORDERS' for subject 'invoices'" in line, line
    assert "NATS_STREAM" in line, line
