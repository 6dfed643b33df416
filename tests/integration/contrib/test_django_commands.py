"""``manage.py outboxkit_status`` / ``outboxkit_relay``: the outboxkit commands on DATABASES."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit import Event, Outbox
from tests.support.relaying import count
from tests.support.servers import consume_nats, ensure_stream


def _write(dsn: str, topic: str, n: int) -> None:
    events = [Event(topic=topic, event_type="order.placed", payload={"n": i}) for i in range(n)]
    with psycopg.connect(dsn) as conn, conn.transaction():
        Outbox().put_many(conn, events)


def test_status_reads_the_outbox_of_databases(
    django_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from django.core.management import call_command

    _write(django_dsn, "orders", 3)
    call_command("outboxkit_status", "--json")
    report = json.loads(capsys.readouterr().out)
    assert (report["pending"], report["table"]) == (3, "outbox")
    call_command("outboxkit_status", "--database", "other", "--json")
    assert json.loads(capsys.readouterr().out)["pending"] == 3


def test_the_commands_take_no_dsn_and_name_a_missing_database(django_dsn: str) -> None:
    from django.core.management import call_command
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--database"):
        call_command("outboxkit_status", "--dsn", "postgresql://elsewhere/db")
    with pytest.raises(CommandError, match="nope"):
        call_command("outboxkit_status", "--database", "nope")
    with pytest.raises(CommandError, match="No such option"):
        call_command("outboxkit_status", "--jsn")


def test_relay_help_lists_the_relays_options(
    django_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from django.core.management import call_command

    call_command("outboxkit_relay", "--help")
    shown = capsys.readouterr().out
    assert "manage.py outboxkit_relay" in shown and "--broker" in shown and "--ordered" in shown


def test_the_relay_command_publishes_to_nats(
    django_dsn: str, nats_server: Any, tmp_path: Path
) -> None:
    suffix = uuid.uuid4().hex[:8]
    stream, topic = f"DJANGO{suffix.upper()}", f"django{suffix}.orders"
    asyncio.run(ensure_stream(nats_server.url, stream, [f"django{suffix}.>"]))
    _write(django_dsn, topic, 5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "tests.integration.contrib.django_settings",
        "OUTBOXKIT_TEST_DJANGO_DSN": django_dsn,
    }
    log = tmp_path / "relay.log"
    with log.open("wb") as out:
        relay = subprocess.Popen(
            [sys.executable, "-m", "django", "outboxkit_relay", "--broker", nats_server.url],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        got = asyncio.run(consume_nats(nats_server.url, stream, topic, 5, timeout=30))
        assert sorted(json.loads(m.data)["n"] for m in got) == [0, 1, 2, 3, 4], log.read_text()
        for _ in range(100):
            if count(django_dsn) == 0:
                break
            time.sleep(0.1)
        assert count(django_dsn) == 0  # settled: published rows deleted
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(timeout=30)
    assert code == 0, log.read_text()
