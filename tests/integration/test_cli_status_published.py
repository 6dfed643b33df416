"""`outboxkit status` says what its published figure means under retention delete."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg

from tests.support.relaying import make_events, write_events


def _status(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outboxkit", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "OUTBOXKIT_DSN": dsn, "COLUMNS": "200"},
    )


def test_published_zero_after_deleting_retention_is_explained(db_dsn: str) -> None:
    """Before: `published 0` right after events were published, and no word why."""
    write_events(db_dsn, make_events("orders", 3))
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox WHERE id IN (SELECT id FROM outbox LIMIT 2)")
    done = _status(db_dsn)
    assert done.returncode == 0, done.stderr
    assert "retention (delete) a published event leaves the table" in done.stdout, done.stdout
    assert "outboxkit_events_published_total" in done.stdout, done.stdout
    assert json.loads(_status(db_dsn, "--json").stdout)["published"] == 0


def test_published_rows_kept_need_no_note(db_dsn: str) -> None:
    write_events(db_dsn, make_events("orders", 2))
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET status = 1, published_at = now()")
    done = _status(db_dsn)
    assert done.returncode == 0, done.stderr
    assert "leaves the table" not in done.stdout, done.stdout
