"""`outboxkit demo` end to end: real servers and real faults; the outbox loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit.testing import EmbeddedNats, EmbeddedPostgres, EmbeddedServerUnavailable
from tests.support.servers import require_or_skip

pytestmark = pytest.mark.slow


# 60 orders/s per path, about the rate of `make demo` (1 500 over 30 s); 5 s is the least
# --duration takes; the broker outage and the relay kill are fractions of it.
_DEMO = (sys.executable, "-m", "outboxkit", "demo", "--orders", "300", "--duration", "5")


def _run_demo(*args: str) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [*_DEMO, "--json", *args],
        capture_output=True,
        timeout=90,
        check=False,
    )
    elapsed = time.monotonic() - started
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, f"demo exited {proc.returncode}:\n{stderr[-4000:]}"
    return json.loads(proc.stdout), elapsed


def _assert_outbox_lost_nothing_and_naive_did(report: dict[str, Any]) -> None:
    outbox, naive = report["outbox"], report["naive"]
    assert report["ok"] is True
    assert outbox["committed"] == 300
    assert outbox["lost"] == 0
    assert outbox["delivered"] == outbox["committed"]
    assert outbox["dead_lettered"] == 0
    assert naive["committed"] == 300
    assert naive["lost"] > 0, "the broker outage must cost the naive path events"
    assert naive["delivered"] + naive["lost"] == naive["committed"]
    assert report["relay_kill"]["held_events"] > 0, "relay-a must die holding a claim"
    assert report["relay_exit_codes"]["relay-b"] == 0, "relay-b must stop cleanly on SIGTERM"


def _demo_databases(admin_dsn: str) -> set[str]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'outboxkit\\_demo\\_%'"
        ).fetchall()
    return {r[0] for r in rows}


def test_demo_on_embedded_servers_outbox_loses_nothing_naive_dual_write_loses_events(
    tmp_path: Path,
) -> None:
    try:  # the constructors only look for the binaries
        EmbeddedPostgres(tmp_path / "pg")
        EmbeddedNats(tmp_path / "nats")
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"`outboxkit demo` needs the embedded servers: {exc}")

    report, elapsed = _run_demo()

    _assert_outbox_lost_nothing_and_naive_did(report)
    assert report["broker"] == "embedded NATS JetStream"
    assert elapsed < 40


def test_demo_on_servers_the_user_runs_cuts_a_proxy_and_drops_its_database(
    pg_server: Any, nats_server: Any
) -> None:
    before = _demo_databases(pg_server.dsn)

    report, _elapsed = _run_demo("--dsn", pg_server.dsn, "--broker", nats_server.url)

    _assert_outbox_lost_nothing_and_naive_did(report)
    assert any("proxy" in fault["event"] for fault in report["faults"])
    assert _demo_databases(pg_server.dsn) <= before, "the demo's scratch database was left behind"


def test_demo_with_the_cdc_relay_loses_nothing_and_the_standby_takes_over(
    tmp_path: Path,
) -> None:
    """`make demo ARGS=--source cdc`: the relays stream a slot; relay-a is SIGKILLed while
    streaming and relay-b, its standby, takes the slot over."""
    try:
        EmbeddedPostgres(tmp_path / "pg", logical=True)
        EmbeddedNats(tmp_path / "nats")
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"`outboxkit demo` needs the embedded servers: {exc}")

    report, elapsed = _run_demo("--source", "cdc")

    outbox, naive = report["outbox"], report["naive"]
    assert report["ok"] is True
    assert (outbox["committed"], outbox["lost"], outbox["delivered"]) == (300, 0, 300)
    assert naive["lost"] > 0, "the broker outage must cost the naive path events"
    assert report["relay_kill"]["taken_over_after_s"] < 10
    assert report["relay_exit_codes"]["relay-b"] == 0, "relay-b must stop cleanly on SIGTERM"
    assert elapsed < 75
