"""The operator's commands against a real database: migrate, status, failed, replay, purge."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from outboxkit.backends.postgres.migrate import migrate, schema_version
from outboxkit.backends.postgres.postgres import SCHEMA_VERSION
from outboxkit.ops.cli import main
from tests.support.relaying import count, make_events, write_events


def cli(*args: str) -> Any:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result


def test_migrate_creates_the_table_and_is_idempotent(empty_db_dsn: str) -> None:
    assert schema_version(empty_db_dsn) is None
    first = cli("migrate", "--dsn", empty_db_dsn)
    assert first.exit_code == 0, first.output
    assert f"schema version {SCHEMA_VERSION}" in first.output
    again = cli("migrate", "--dsn", empty_db_dsn)
    assert again.exit_code == 0
    assert schema_version(empty_db_dsn) == SCHEMA_VERSION
    with psycopg.connect(empty_db_dsn) as conn:
        opts = conn.execute("SELECT reloptions FROM pg_class WHERE relname = 'outbox'").fetchone()
        indexes = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = 'outbox'"
        ).fetchall()
    assert opts is not None and "autovacuum_vacuum_scale_factor=0" in opts[0]
    assert any("WHERE (status = 0)" in i[0] for i in indexes)


def test_migrating_from_two_processes_at_once_is_safe(empty_db_dsn: str) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def run() -> None:
        try:
            barrier.wait()
            migrate(empty_db_dsn, table="app_events")
        except BaseException as exc:  # pragma: no cover - the failure we test against
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert schema_version(empty_db_dsn, table="app_events") == SCHEMA_VERSION


def test_print_sql_output_creates_the_same_schema_as_migrate(empty_db_dsn: str) -> None:
    ddl = cli("migrate", "--print-sql")
    assert ddl.exit_code == 0
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute(ddl.output)
    # a database set up by hand from --print-sql is recognised as current
    assert schema_version(empty_db_dsn) == SCHEMA_VERSION
    assert cli("migrate", "--dsn", empty_db_dsn).exit_code == 0


def test_status_json_reports_pending_in_flight_failed_and_oldest_age(db_dsn: str) -> None:
    write_events(db_dsn, make_events("orders", 7) + make_events("payments", 3))
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox SET status = 2, last_error = 'boom' WHERE id IN"
            " (SELECT id FROM outbox WHERE topic = 'payments' LIMIT 1)"
        )
        conn.execute(
            "UPDATE outbox SET claim_token = gen_random_uuid(),"
            " available_at = now() + interval '30 s' WHERE id IN"
            " (SELECT id FROM outbox WHERE topic = 'orders' LIMIT 2)"
        )
        conn.execute("UPDATE outbox SET created_at = now() - interval '90 s'")
    out = cli("status", "--dsn", db_dsn, "--json")
    assert out.exit_code == 0
    data = json.loads(out.output)
    assert (data["pending"], data["in_flight"], data["failed"]) == (7, 2, 1)
    assert data["oldest_pending_age_s"] >= 90
    by_topic = {t["topic"]: t for t in data["topics"]}
    assert by_topic["orders"]["in_flight"] == 2
    assert by_topic["payments"]["failed"] == 1
    human = cli("status", "--dsn", db_dsn)
    assert "orders" in human.output and "dead letters present" in human.output


def test_failed_list_show_and_replay_put_dead_letters_back_in_line(db_dsn: str) -> None:
    events = make_events("orders", 3)
    write_events(db_dsn, events)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET status = 2, attempts = 10, last_error = 'broker said no'")
    listed = json.loads(cli("failed", "list", "--dsn", db_dsn, "--json").output)
    assert [r["event_id"] for r in listed] == [str(e.event_id) for e in events]
    assert listed[0]["last_error"] == "broker said no"
    shown = cli("failed", "show", str(events[0].event_id), "--dsn", db_dsn, "--json")
    detail = json.loads(shown.output)
    assert detail["payload"] == {"order": 0, "note": "é ✓"}
    assert detail["status"] == "failed"
    by_id = cli("replay", "--dsn", db_dsn, "--id", str(listed[0]["id"]))
    assert "1 event(s) back to pending" in by_id.output
    assert count(db_dsn, "status = 0 AND attempts = 0") == 1
    rest = cli("replay", "--dsn", db_dsn, "--all-failed")
    assert "2 event(s)" in rest.output
    assert count(db_dsn, "status = 2") == 0
    nothing = cli("replay", "--dsn", db_dsn)
    assert nothing.exit_code == 2


def test_purge_deletes_old_published_rows_in_batches_and_keeps_the_rest(db_dsn: str) -> None:
    write_events(db_dsn, make_events("orders", 25))
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox SET status = 1, published_at = now() - interval '10 days'"
            " WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 20)"
        )
        conn.execute(
            "UPDATE outbox SET status = 1, published_at = now() WHERE status = 0"
            " AND id IN (SELECT id FROM outbox WHERE status = 0 ORDER BY id LIMIT 2)"
        )
    out = cli("purge", "--dsn", db_dsn, "--older-than", "7d", "--batch-size", "6", "--json")
    assert json.loads(out.output) == {"deleted": 20}
    assert count(db_dsn) == 5
    assert count(db_dsn, "status = 1") == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "--dsn", "postgresql://u:hunter2@127.0.0.1:1/x"], "cannot reach the database"),
        (["status", "--dsn", "{db}", "--table", "nope"], "outboxkit migrate"),
        (["status", "--dsn", "{db}", "--table", "x;drop"], "invalid outbox table name"),
    ],
)
def test_cli_errors_are_one_readable_line_without_secrets(
    db_dsn: str, args: list[str], message: str
) -> None:
    argv = [a.replace("{db}", db_dsn) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "outboxkit", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode != 0
    assert message in proc.stderr.replace("\n", " ")
    assert "Traceback" not in proc.stderr
    assert "hunter2" not in proc.stderr + proc.stdout


def test_help_teaches_with_examples() -> None:
    out = cli("relay", "--help")
    assert "Example" in out.output and "SIGTERM" in out.output
    assert "OUTBOXKIT_DSN" in out.output


def test_failed_show_masks_credential_headers_by_name(db_dsn: str) -> None:
    """`failed show` printed an event's headers as stored: `Bearer s3cr3t` (too short for
    the free-text Bearer net) and `Token abcdefghijkl` showed, in the table and in --json."""
    from outboxkit import Event

    event = Event(
        topic="orders",
        event_type="order.placed",
        payload={},
        headers={"authorization": "Bearer s3cr3t", "x-api-token": "Token abcdefghijkl",
                 "x-tenant": "acme"},
    )  # fmt: skip
    write_events(db_dsn, [event])
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET status = 2, last_error = 'no'")
    for extra in ((), ("--json",)):
        shown = cli("failed", "show", str(event.event_id), "--dsn", db_dsn, *extra).output
        assert "s3cr3t" not in shown and "abcdefghijkl" not in shown, extra
        assert "authorization" in shown and "acme" in shown, extra
