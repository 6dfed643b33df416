"""The servers the tests run against, and small clients that read back what a relay published."""

from __future__ import annotations

import contextlib
import os
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Message, TopicPartition

from outboxkit._redact import redact
from outboxkit.testing import (
    EmbeddedKafka,
    EmbeddedPostgres,
    TcpProxy,
    dsn_with_dbname,
    port_accepts,
)

REQUIRE_SERVICES_ENV = "OUTBOXKIT_REQUIRE_SERVICES"
PG_DSN_ENV = "OUTBOXKIT_TEST_DSN"
NATS_URL_ENV = "OUTBOXKIT_TEST_NATS_URL"
KAFKA_ENV = "OUTBOXKIT_TEST_KAFKA"


def require_or_skip(reason: str) -> NoReturn:
    """Skip for a missing server; fail instead when OUTBOXKIT_REQUIRE_SERVICES=1 (CI)."""
    if os.environ.get(REQUIRE_SERVICES_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_SERVICES_ENV}=1 forbids skipping)", pytrace=False)
    pytest.skip(reason)


def stop_without_postgres(reason: str) -> NoReturn:
    """End the run with one line saying why there is no PostgreSQL and how to give it one.

    Nearly every integration test needs PostgreSQL: failing each of them repeats one cause
    140 times, and skipping them turns a broken set-up into a green run. Tests that need no
    server (tests/unit) still run when selected on their own.
    """
    pytest.exit(
        f"no PostgreSQL for the tests: {reason} — to use one you run, set "
        f"{PG_DSN_ENV}=postgresql://USER@HOST:5432/postgres",
        returncode=pytest.ExitCode.TESTS_FAILED,
    )


@contextlib.contextmanager
def password_postgres(role: str, password: str, database: str) -> Iterator[EmbeddedPostgres]:
    """A private PostgreSQL where ``role`` (a superuser) logs in with ``password`` only, with
    an empty ``database`` (the session's server trusts every login, so a wrong password
    would pass there)."""
    server = EmbeddedPostgres(fsync=False)
    server.start()
    try:
        hba = server.data_dir / "pg_hba.conf"
        owner = hba.stat()
        hba.write_text(
            f"host all {role} 127.0.0.1/32 scram-sha-256\nhost all all 127.0.0.1/32 trust\n"
        )
        os.chown(hba, owner.st_uid, owner.st_gid)  # (the server's user when run as root)
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{password}'")
            conn.execute(f"CREATE DATABASE {database}")
            conn.execute("SELECT pg_reload_conf()")
        yield server
    finally:
        server.close()


def unique_name(prefix: str) -> str:
    """A name no other test (or concurrent test session) uses: `prefix_<12 hex>`."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------- PostgreSQL


@dataclass(frozen=True)
class ExternalPostgres:
    """A PostgreSQL the test session did not start (OUTBOXKIT_TEST_DSN)."""

    dsn: str

    def dsn_for(self, dbname: str) -> str:
        return dsn_with_dbname(self.dsn, dbname)


def check_postgres(dsn: str) -> None:
    """End the run with one line when the configured PostgreSQL does not answer."""
    try:
        psycopg.connect(dsn, connect_timeout=5).close()
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        pytest.exit(
            f"no PostgreSQL for the tests: {PG_DSN_ENV}={redact(dsn)} is not reachable: {first}"
            f" — start it, or unset {PG_DSN_ENV} to use the embedded one",
            returncode=pytest.ExitCode.TESTS_FAILED,
        )


# --------------------------------------------------------------------------- NATS


@dataclass(frozen=True)
class ExternalNats:
    """A NATS server with JetStream the session did not start (OUTBOXKIT_TEST_NATS_URL)."""

    url: str


def check_nats(url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    if not port_accepts(parts.port or 4222, host=parts.hostname or "127.0.0.1", timeout=2.0):
        require_or_skip(f"NATS at {NATS_URL_ENV}={redact(url)} is not reachable")


async def ensure_stream(url: str, name: str, subjects: list[str]) -> None:
    """Create JetStream stream `name` over `subjects`, or point an existing one at them."""
    import nats
    from nats.js.api import StreamConfig
    from nats.js.errors import BadRequestError

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream()
        try:
            await js.add_stream(name=name, subjects=subjects)
        except BadRequestError as exc:
            if exc.err_code != 10058:  # "stream name already in use with a different configuration"
                raise
            await js.update_stream(StreamConfig(name=name, subjects=subjects))
    finally:
        await nc.close()


async def consume_nats(
    url: str, stream: str, subject: str, n: int | None, timeout: float = 10.0
) -> list[Any]:
    """Read up to `n` messages of `subject` from the start of `stream` (fewer on timeout).

    An ephemeral pull consumer: nothing is left behind on the server, and messages already
    read by other consumers are read again. The returned `nats.aio.msg.Msg` objects keep
    their data, headers and metadata after the connection is closed.

    `n=None`: every message the stream stores when the consumer is made (its pending
    count), all of them or an AssertionError: the final read once the publishers have
    stopped. Asking for one more than expected proves "nothing extra" only by waiting out
    the timeout; the stream's own count proves it at once.
    """
    import nats
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    deadline = time.monotonic() + timeout
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            subject,
            stream=stream,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.ALL,
                ack_policy=AckPolicy.NONE,
                inactive_threshold=30.0,
            ),
        )
        every = n is None
        if n is None:
            n = (await sub.consumer_info()).num_pending or 0
        messages: list[Any] = []
        while len(messages) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                messages += await sub.fetch(n - len(messages), timeout=min(remaining, 1.0))
            except (TimeoutError, NatsTimeout):
                continue
        await sub.unsubscribe()
        assert not every or len(messages) == n, f"{stream} stores {n}, {len(messages)} read"
        return messages
    finally:
        await nc.close()


# --------------------------------------------------------------------------- Kafka


@dataclass(frozen=True)
class ExternalKafka:
    """A Kafka-protocol broker the session did not start (OUTBOXKIT_TEST_KAFKA=host:port)."""

    bootstrap: str

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"


def check_kafka(bootstrap: str) -> None:
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    if not port_accepts(int(port or 9092), host=host or "127.0.0.1", timeout=2.0):
        require_or_skip(f"Kafka at {KAFKA_ENV}={bootstrap} is not reachable")


@dataclass(frozen=True)
class KafkaBehindProxy:
    """A fresh broker that advertises a TcpProxy's port, so every client connection can be cut."""

    broker: EmbeddedKafka
    proxy: TcpProxy

    @property
    def bootstrap(self) -> str:
        return self.broker.bootstrap

    @property
    def url(self) -> str:
        return self.broker.url


def consume_kafka(bootstrap: str, topic: str, n: int, timeout: float = 20.0) -> list[Message]:
    """Read up to `n` messages of `topic` from the beginning of every partition (fewer on timeout).

    Partitions are assigned directly, so there is no group rebalance to wait for; a topic that
    does not exist yet is waited for. Blocking: call it via `asyncio.to_thread` from async tests.

    `timeout` bounds the wait for the first message and for each silence after one: a read
    that keeps making progress is not cut off. On a loaded machine Tansu serves a few thousand
    records slower than a fixed 30 s allowed, and a short read looked like a lost message.
    """
    deadline = time.monotonic() + timeout
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": unique_name("outboxkit-test-reader"),
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        partitions = _partitions(consumer, topic, deadline)
        if not partitions:
            return []
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        messages: list[Message] = []
        while len(messages) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            msg = consumer.poll(min(remaining, 0.5))
            if msg is None:
                continue
            error = msg.error()
            if error is not None:
                if error.fatal():
                    raise KafkaException(error)
                continue
            messages.append(msg)
            deadline = max(deadline, time.monotonic() + min(timeout, 5.0))
        return messages
    finally:
        consumer.close()


def _partitions(consumer: Consumer, topic: str, deadline: float) -> list[int]:
    while True:
        remaining = deadline - time.monotonic()
        try:
            metadata = consumer.list_topics(topic, timeout=max(0.1, min(remaining, 2.0)))
            found = metadata.topics.get(topic)
            if found is not None and found.error is None and found.partitions:
                return sorted(found.partitions)
        except KafkaException:
            pass
        if remaining <= 0:
            return []
        time.sleep(0.1)
