"""`replay` and `failed discard` take row or event ids and say when nothing matched.

The CLI runs as a subprocess, as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg

from tests.support.relaying import count, make_events, write_events


def _outboxkit(dsn: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outboxkit", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "OUTBOXKIT_DSN": dsn, "COLUMNS": "60"},
    )


def _dead_letter(dsn: str, topic: str, n: int) -> list[str]:
    events = make_events(topic, n)
    write_events(dsn, events)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET status = 2, last_error = 'no' WHERE topic = %s", (topic,))
    return [str(e.event_id) for e in events]


def test_replay_of_an_id_that_matches_nothing_says_so_and_exits_non_zero(db_dsn: str) -> None:
    """Before: `✓ 0 event(s) back to pending`, exit 0."""
    _dead_letter(db_dsn, "orders", 1)
    for ref in ("999", str(uuid.uuid4())):
        done = _outboxkit(db_dsn, "replay", "--id", ref)
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"no failed event with id {ref}" in done.stderr, done.stderr
        assert "0 event(s)" not in done.stdout, done.stdout
    nothing = _outboxkit(db_dsn, "replay", "--topic", "nosuchtopic")
    assert nothing.returncode == 1 and "no failed event of topic" in nothing.stderr
    assert count(db_dsn, "status = 2") == 1


def test_replay_takes_an_event_id_as_failed_show_does(db_dsn: str) -> None:
    """Before: `--id` refused a UUID (`is not a valid integer`)."""
    event_id, other = _dead_letter(db_dsn, "orders", 2)
    done = _outboxkit(db_dsn, "replay", "--id", event_id)
    assert done.returncode == 0, done.stderr
    assert "1 event(s) back to pending" in done.stdout
    with psycopg.connect(db_dsn) as conn:
        rows = conn.execute("SELECT event_id::text, status FROM outbox ORDER BY id").fetchall()
    assert rows == [(event_id, 0), (other, 2)]
    bad = _outboxkit(db_dsn, "replay", "--id", "not-an-id")
    assert bad.returncode == 2 and "neither a row id nor an event id" in bad.stderr


def test_failed_discard_by_id_topic_and_all_with_a_confirmation_for_bulk(db_dsn: str) -> None:
    """Before: no such command; only the dashboard could discard a dead letter."""
    orders = _dead_letter(db_dsn, "orders", 3)
    _dead_letter(db_dsn, "payments", 2)
    write_events(db_dsn, make_events("orders", 1))  # pending: never discarded
    one = _outboxkit(db_dsn, "failed", "discard", "--id", orders[0])
    assert one.returncode == 0 and "discarded 1 failed event(s)" in one.stdout, one.stderr
    again = _outboxkit(db_dsn, "failed", "discard", "--id", orders[0])
    assert again.returncode == 1 and "no failed event with id" in again.stderr
    refused = _outboxkit(db_dsn, "failed", "discard", "--topic", "orders", stdin="n\n")
    assert refused.returncode == 1 and "nothing discarded" in refused.stderr
    assert count(db_dsn, "status = 2 AND topic = 'orders'") == 2
    topic = _outboxkit(db_dsn, "failed", "discard", "--topic", "orders", stdin="y\n")
    assert topic.returncode == 0 and "discarded 2" in topic.stdout, topic.stderr
    every = _outboxkit(db_dsn, "failed", "discard", "--all-failed", "--yes")
    assert every.returncode == 0 and "discarded 2" in every.stdout, every.stderr
    assert count(db_dsn, "status = 2") == 0
    assert count(db_dsn, "status = 0") == 1
