"""Structured logs of a full relay run: JSON lines, failures with their context, no secrets."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit import Event
from outboxkit.testing import free_port
from tests.support.relaying import count, wait_for, write_events
from tests.support.servers import ensure_stream

PASSWORD = "Sup3r-s3cret-" + uuid.uuid4().hex[:8]
PAYLOAD_MARK = "payload-body-" + uuid.uuid4().hex[:8]


def _with_password(dsn: str, host_port: str) -> str:
    """The test server trusts loopback, so the password is carried but never checked."""
    parts = urllib.parse.urlsplit(dsn)
    return parts._replace(netloc=f"{parts.username}:{PASSWORD}@{host_port}").geturl()


async def test_a_full_relay_run_logs_json_with_failure_context_and_never_the_password(
    db_dsn: str, nats_server: Any, proxy_factory: Any, tmp_path: Path
) -> None:
    root = f"l{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    good, poison = f"{root}.orders", f"nostream{uuid.uuid4().hex[:8]}"
    write_events(
        db_dsn,
        [Event(topic=good, event_type="x", payload={"m": PAYLOAD_MARK}) for _ in range(20)]
        + [Event(topic=poison, event_type="x", payload={"m": PAYLOAD_MARK})],
    )
    port = urllib.parse.urlsplit(db_dsn).port
    assert port is not None
    proxy = proxy_factory("127.0.0.1", port)
    dsn = _with_password(db_dsn, f"127.0.0.1:{proxy.port}")
    nats = urllib.parse.urlsplit(nats_server.url)
    broker = f"nats://outboxkit:{PASSWORD}@{nats.hostname}:{nats.port}?timeout=1"
    env = {**os.environ, "OUTBOXKIT_DSN": dsn, "OUTBOXKIT_BROKER": broker}
    log_path = tmp_path / "relay.log"
    cmd = [sys.executable, "-m", "outboxkit", "relay", "--log-format", "json"]
    args = ["--log-level", "debug", "--log-interval", "0.2", "--max-attempts", "2"]
    args += ["--retry-base", "0.1", "--retry-cap", "0.2", "--poll-interval", "0.2"]
    args += ["--metrics-port", str(free_port()), "--metrics-host", "127.0.0.1"]
    relay = _start(cmd + args, log_path, env)
    try:
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, timeout=30, what="settled")
        proxy.cut()  # database outage: reconnect warnings carry psycopg's messages
        await wait_for(
            lambda: "database unavailable" in log_path.read_text(), timeout=20, what="outage log"
        )
        proxy.resume()
        write_events(db_dsn, [Event(topic=good, event_type="x", payload={"m": PAYLOAD_MARK})])
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, timeout=30, what="recovered")
        await wait_for(
            lambda: "database back" in log_path.read_text(), timeout=20, what="back line"
        )
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(30)
    text = log_path.read_text()
    assert code == 0, text[-3000:]

    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert all({"ts", "level", "logger", "msg"} <= set(entry) for entry in lines)
    # each failure at DEBUG, with its context; the failing state is one WARNING
    retried = [e for e in lines if e["level"] == "debug" and "will retry" in e["msg"]]
    assert retried and all(
        f"topic={poison}" in e["msg"] and "attempt=1" in e["msg"] and "error_class=" in e["msg"]
        for e in retried
    )
    assert all(e["topic"] == poison and e["event_id"] and e["error_class"] for e in retried)
    [failing] = [e for e in lines if e["msg"].startswith("publishing failing")]
    assert failing["level"] == "warning" and f"topic={poison}" in failing["msg"]
    [dead] = [e for e in lines if e["level"] == "error" and "dead-lettered" in e["msg"]]
    assert f"topic={poison}" in dead["msg"] and "event_id=" in dead["msg"]
    summaries = [e for e in lines if e["msg"].startswith("relay summary")]
    assert summaries and sum(e["published"] for e in summaries) >= 20
    # the database outage: one WARNING (a reminder only past 30 s), one INFO when it is back
    db = [e for e in lines if e["level"] == "warning" and e["msg"].startswith("database")]
    assert len(db) == 1 and "database unavailable" in db[0]["msg"], db
    assert [e for e in lines if e["level"] == "info" and e["msg"].startswith("database back")]

    # every output of the run and of the CLI's help and errors, grepped for the secret
    help_text = _run(["relay", "--help"], env)
    bad_db = _run(["status"], {**env, "OUTBOXKIT_DSN": _with_password(db_dsn, "127.0.0.1:1")})
    assert bad_db.returncode == 3 and "cannot reach the database" in bad_db.stderr
    for output in (text, help_text.stdout, help_text.stderr, bad_db.stdout, bad_db.stderr):
        assert PASSWORD not in output
    assert PAYLOAD_MARK not in text, "payload bodies are never logged"
    assert f"nats://outboxkit:***@{nats.hostname}" in text, "the URLs are logged, masked"


def _start(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outboxkit", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


FORGED_LINE = "2026-01-01 00:00:00,000 WARNING outboxkit.audit: admin password reset by root"
RECORD_START = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
)


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_a_topic_with_a_newline_cannot_forge_a_log_line(
    db_dsn: str, tmp_path: Path, fmt: str
) -> None:
    forged = f"forge{uuid.uuid4().hex[:6]}\n{FORGED_LINE}\r\x1b[1A\x85"
    # Written as another writer (or an older outboxkit) could: the relay must log it safely.
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (event_id, topic, key, event_type, payload, headers)"
            " VALUES (%s, %s, %s, 'x', '{}', '{}'::jsonb)",
            (uuid.uuid4(), forged, forged),
        )
    broker = f"nats://127.0.0.1:{free_port()}?timeout=1"  # nothing listens: every publish fails
    env = {**os.environ, "OUTBOXKIT_DSN": db_dsn, "OUTBOXKIT_BROKER": broker}
    cmd = [sys.executable, "-m", "outboxkit", "relay", "--log-format", fmt, "--log-level", "debug"]
    cmd += ["--max-attempts", "1", "--poll-interval", "0.2"]
    log_path = tmp_path / "relay.log"
    relay = _start(cmd, log_path, env)
    try:
        # dead-lettered (refused subject) or failing (no server): either line names the topic
        await wait_for(
            lambda: forged[:11] in log_path.read_text(), timeout=30, what="the topic logged"
        )
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(30)
    raw = log_path.read_bytes()
    text = raw.decode()
    assert code == 0, text[-3000:]
    assert b"\r" not in raw and b"\x1b" not in raw and "\x85" not in text
    lines = text.splitlines()
    assert not [line for line in lines if line.startswith(FORGED_LINE[:30])]
    if fmt == "json":
        entries = [json.loads(line) for line in lines]
        logged = [e for e in entries if forged in e["msg"]]
    else:
        assert all(RECORD_START.match(line) or line.startswith("    ") for line in lines), text
        logged = [line for line in lines if f"\\n{FORGED_LINE}\\r\\x1b[1A\\x85" in line]
    assert logged, "the topic was logged (escaped)"
