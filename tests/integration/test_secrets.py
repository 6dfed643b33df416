"""Secrets of the configured URLs never show: not in logs, /readyz, last_error or the dashboard.

A real relay process is given a token-only NATS URL (``nats://TOKEN@host``) for a real
nats-server that requires that token, runs through failures and a broker outage with the
dashboard on, and every surface that prints, stores or serves text is read back and
searched for the token. A webhook relay does the same with ``https://TOKEN@host`` and an
``?api_key=`` query string against a closed port.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from outboxkit import Event
from outboxkit.testing import EmbeddedNats, EmbeddedServerUnavailable, free_port
from tests.support.relaying import count, wait_for, write_events
from tests.support.servers import ensure_stream, require_or_skip

TOKEN = "tok" + uuid.uuid4().hex
API_KEY = "key" + uuid.uuid4().hex


class _TokenNats(EmbeddedNats):
    """nats-server that accepts only clients presenting ``TOKEN``."""

    def _command(self) -> list[str]:
        return [*super()._command(), "--auth", TOKEN]

    @property
    def url(self) -> str:
        return f"nats://{TOKEN}@127.0.0.1:{self.port}"


@pytest.fixture
def token_nats(tmp_path: Path) -> Iterator[_TokenNats]:
    try:
        server = _TokenNats(tmp_path / "nats")
        server.start()
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"embedded NATS unavailable: {exc}")
    try:
        yield server
    finally:
        server.close()


def _relay(dsn: str, broker: str, log_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUTBOXKIT_DSN": dsn, "OUTBOXKIT_BROKER": broker}
    cmd = [sys.executable, "-m", "outboxkit", "relay", "--log-level", "debug"]
    cmd += ["--retry-base", "0.1", "--retry-cap", "0.3", "--poll-interval", "0.2", *extra]
    with log_path.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _last_errors(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT last_error FROM outbox WHERE last_error IS NOT NULL")
        return [r[0] for r in rows.fetchall()]


async def test_a_token_url_never_shows_in_logs_readyz_last_error_or_the_dashboard(
    db_dsn: str, token_nats: _TokenNats, tmp_path: Path
) -> None:
    root = f"s{uuid.uuid4().hex[:8]}"
    await ensure_stream(token_nats.url, root.upper(), [f"{root}.>"])
    write_events(
        db_dsn, [Event(topic=f"{root}.orders", event_type="x", payload={}) for _ in range(10)]
    )
    # no stream: every publish fails, is retried once, then dead-lettered with its error
    write_events(db_dsn, [Event(topic=f"nostream{root}", event_type="x", payload={})])
    port = free_port()
    log_path = tmp_path / "relay.log"
    broker = f"{token_nats.url}?timeout=1"
    args = ["--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--dashboard"]
    relay = _relay(db_dsn, broker, log_path, *args, "--max-attempts", "2")
    served: list[str] = []
    try:
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, timeout=30, what="settled")
        assert count(db_dsn, "status = 2") == 1
        token_nats.stop()  # the outage: the client's reconnect errors, /readyz turns 503
        write_events(db_dsn, [Event(topic=f"{root}.orders", event_type="x", payload={})] * 1)
        ready = []
        for _ in range(60):
            status, body = await asyncio.to_thread(_get, port, "/readyz")
            served.append(body)
            ready.append(status)
            # the outage's error stored on a row waiting for the broker
            if status == 503 and count(db_dsn, "status = 0 AND last_error IS NOT NULL"):
                break
            await asyncio.sleep(0.5)
        assert 503 in ready, served[-3:]
        for path in ("/api/overview", "/api/failed"):
            status, body = await asyncio.to_thread(_get, port, f"/dashboard{path}")
            assert status == 200, body
            served.append(body)
        for row_id in _ids(db_dsn):
            served.append(
                (await asyncio.to_thread(_get, port, f"/dashboard/api/events/{row_id}"))[1]
            )
        token_nats.start()
        await wait_for(_publish_one(db_dsn, f"{root}.orders"), timeout=30, interval=1)
        await wait_for(
            lambda: "publishing recovered" in log_path.read_text(), timeout=30, what="recovery"
        )
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(30)
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    errors = _last_errors(db_dsn)
    assert errors, "failures were stored"
    assert any("last_error" in body for body in served), "the dashboard served the errors"
    for where, output in [("log", text), ("readyz/dashboard", "\n".join(served))] + [
        ("last_error", e) for e in errors
    ]:
        assert TOKEN not in output, f"token in the {where}"
    assert f"nats://***@127.0.0.1:{token_nats.port}" in text, "the URL is logged, masked"


async def test_a_webhook_token_and_api_key_never_show_in_logs_or_last_error(
    db_dsn: str, tmp_path: Path
) -> None:
    closed = free_port()
    url = f"http://{TOKEN}@127.0.0.1:{closed}/hooks/{{topic}}?api_key={API_KEY}&sig={API_KEY}x"
    write_events(db_dsn, [Event(topic="orders", event_type="x", payload={})])
    log_path = tmp_path / "relay.log"
    relay = _relay(db_dsn, url, log_path, "--max-attempts", "2")
    try:
        # The receiver is unreachable: the event is handed back (not dead-lettered, an outage
        # burns no attempt) with the error stored in last_error.
        await wait_for(
            lambda: count(db_dsn, "last_error IS NOT NULL") == 1, timeout=30, what="a stored error"
        )
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(30)
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    [error] = _last_errors(db_dsn)
    for output in (text, error):
        assert TOKEN not in output and API_KEY not in output
    assert f"http://***@127.0.0.1:{closed}/hooks/{{topic}}?api_key=***&sig=***" in text


def _publish_one(dsn: str, topic: str) -> Callable[[], bool]:
    """A condition that writes an event per call and is true once any of them was published.

    Events retry only twice in this run, so the first ones after the restart may be
    dead-lettered before the client has reconnected.
    """
    base, written = count(dsn), [0]

    def condition() -> bool:
        gone = count(dsn) < base + written[0]  # published rows are deleted
        write_events(dsn, [Event(topic=topic, event_type="x", payload={})])
        written[0] += 1
        return gone

    return condition


def _ids(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT id FROM outbox ORDER BY id").fetchall()]


# A password with a "%" that starts no escape: psycopg's parse error quotes it whole.
BAD_ESCAPE_PASSWORD = "S3cret%ZZpass"
BAD_DSN = f"postgresql://u:{BAD_ESCAPE_PASSWORD}@127.0.0.1/db"


def _outboxkit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outboxkit", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "60", **(env or {})},
    )


@pytest.mark.parametrize(
    ("command", "in_env"),
    [
        (["relay", "--broker", "nats://127.0.0.1:1"], False),
        (["relay", "--broker", "nats://127.0.0.1:1"], True),
        (["migrate"], True),
        (["status"], True),
        (["purge", "--older-than", "7d"], True),
        (["dashboard", "--port", "0"], True),
        (["cdc", "status"], True),
        (["demo", "--orders", "10", "--duration", "1"], False),
    ],
)
def test_a_dsn_that_does_not_parse_is_one_line_with_its_password_masked(
    command: list[str], in_env: bool
) -> None:
    """Before: an uncaught traceback ending in `invalid percent-encoded token: "S3cret%ZZpass"`."""
    if in_env:
        done = _outboxkit(*command, env={"OUTBOXKIT_DSN": BAD_DSN})
    else:
        done = _outboxkit(*command, "--dsn", BAD_DSN)
    output = done.stdout + done.stderr
    assert "S3cret" not in output and "ZZpass" not in output, output
    assert "Traceback" not in output, output
    assert done.returncode == 2, output
    [line] = done.stderr.splitlines()
    assert line.startswith("error: --dsn (or OUTBOXKIT_DSN) is not a valid PostgreSQL"), line
    assert 'invalid percent-encoded token: "***"' in line and "%25" in line, line


async def test_a_webhook_secret_in_the_url_path_never_shows_in_logs_or_last_error(
    db_dsn: str, tmp_path: Path
) -> None:
    """Before: the relay's start line logged a Slack-style URL verbatim at INFO."""
    closed = free_port()
    secret = "Xq" + uuid.uuid4().hex  # the last segment of /services/T…/B…/SECRET
    url = f"http://127.0.0.1:{closed}/services/T0001/B0001/{secret}"
    write_events(db_dsn, [Event(topic="orders", event_type="x", payload={})])
    log_path = tmp_path / "relay.log"
    relay = _relay(db_dsn, url, log_path, "--max-attempts", "2")
    try:
        await wait_for(
            lambda: count(db_dsn, "last_error IS NOT NULL") == 1, timeout=30, what="a stored error"
        )
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(30)
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    [error] = _last_errors(db_dsn)
    for output in (text, error):
        assert secret not in output, output[-3000:]
    assert f"to http://127.0.0.1:{closed}/services/***/***/***" in text, text[-3000:]
