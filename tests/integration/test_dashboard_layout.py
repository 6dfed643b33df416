"""Dashboard numbers sit under their headers; the relay names /dashboard/ when it serves it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import psycopg

from outboxkit import Event
from outboxkit.ops.dashboard import Dashboard
from outboxkit.testing import free_port
from tests.integration.test_dashboard import chromium, served
from tests.support.relaying import write_events

# For each table: the alignment of every header and of the cell under it.
_ALIGNMENTS = """
(id) => {
  const table = document.getElementById(id);
  const heads = [...table.querySelectorAll('thead th')];
  const cells = [...table.querySelector('tbody tr').children];
  return heads.map((th, i) => [th.textContent, getComputedStyle(th).textAlign,
                               getComputedStyle(cells[i]).textAlign]);
}
"""


async def test_numeric_headers_are_aligned_like_their_numbers(db_dsn: str) -> None:
    """Before: left-aligned headers over right-aligned numbers (each under the next header)."""
    write_events(db_dsn, [Event(topic="orders", event_type="x", payload={}) for _ in range(2)])
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox SET status = 2, attempts = 3, last_error = 'no'"
            " WHERE id = (SELECT min(id) FROM outbox)"
        )
    board = Dashboard(db_dsn, sample_interval=0.5)
    async with served(board) as url, chromium() as browser:
        page = await browser.new_page()
        await page.goto(url + "/")
        for table in ("topics", "failed"):
            await page.wait_for_selector(f"#{table} tbody tr")
            columns: list[list[Any]] = await page.evaluate(_ALIGNMENTS, table)
            for header, head_align, cell_align in columns:
                assert head_align == cell_align, (table, header, head_align, cell_align)
            assert any(cell == "right" for _, _, cell in columns), columns


def test_the_relay_start_line_lists_the_dashboard_when_it_serves_it(db_dsn: str) -> None:
    """Before: `serving http://…:PORT (/metrics /healthz /readyz; …)` with --dashboard on."""
    port = free_port()
    relay = subprocess.Popen(
        [
            sys.executable, "-m", "outboxkit", "relay", "--broker", "nats://127.0.0.1:1",
            "--metrics-port", str(port), "--dashboard",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OUTBOXKIT_DSN": db_dsn},
    )  # fmt: skip
    assert relay.stdout is not None
    line = ""
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and "serving http://" not in line:
            line = relay.stdout.readline()
            if not line:
                break
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.communicate(timeout=30)
    assert "serving http://" in line, line
    assert "/metrics /healthz /readyz /dashboard/" in line, line
