"""CLI tables keep ids whole when piped or in a narrow terminal; --json stays the machine form.

The CLI runs as a subprocess, once with its output in a pipe (no terminal: rich's default
was 80 columns) and once on a pseudo-terminal 60 columns wide.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import psycopg

from tests.support.relaying import make_events, write_events

LONG_ERROR = "broker said no: " + "the subject is not bound to any stream " * 5


def _env(dsn: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return {**env, "OUTBOXKIT_DSN": dsn, **extra}


def _dead_letters(dsn: str) -> list[str]:
    events = make_events("orders", 2)
    write_events(dsn, events)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET status = 2, last_error = %s", (LONG_ERROR,))
    return [str(e.event_id) for e in events]


def test_failed_list_piped_keeps_event_ids_and_errors_on_one_line(db_dsn: str) -> None:
    """Before: each event id split over three lines and the error cut, at 80 columns."""
    ids = _dead_letters(db_dsn)
    done = subprocess.run(
        [sys.executable, "-m", "outboxkit", "failed", "list"],
        capture_output=True, text=True, timeout=60, check=False, env=_env(db_dsn),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for event_id in ids:
        [line] = [line for line in lines if event_id in line]
        assert LONG_ERROR.strip() in line, line
    as_json = subprocess.run(
        [sys.executable, "-m", "outboxkit", "failed", "list", "--json"],
        capture_output=True, text=True, timeout=60, check=False, env=_env(db_dsn),
    )  # fmt: skip
    assert [r["event_id"] for r in json.loads(as_json.stdout)] == ids


def test_failed_list_in_a_narrow_terminal_does_not_split_event_ids(db_dsn: str) -> None:
    ids = _dead_letters(db_dsn)
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outboxkit", "failed", "list"],
            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
            env=_env(db_dsn, COLUMNS="60", TERM="dumb"),
        )  # fmt: skip
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(60) == 0
    finally:
        os.close(leader)
    text = b"".join(chunks).decode()
    for event_id in ids:
        assert event_id in text, text
