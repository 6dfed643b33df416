"""Identifiers are validated and quoted in one place; statements render per table."""

from __future__ import annotations

import datetime as dt

import click
import pytest

from outboxkit import ConfigurationError, Event, Outbox
from outboxkit._redact import redact
from outboxkit.backends.postgres.postgres import Statements, channel_for, numbered, parse_table
from outboxkit.ops.cli import parse_duration


@pytest.mark.parametrize("name", ["outbox", "app.outbox", "_x1", "a" * 63])
def test_valid_table_names_are_accepted(name: str) -> None:
    assert Statements(name).qualified.count('"') in (2, 4)


@pytest.mark.parametrize(
    "name", ["", "1abc", "a-b", 'x"; drop table y; --', "a.b.c", "a b", "a" * 64, "sch.", ".t"]
)
def test_invalid_table_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid outbox table name"):
        parse_table(name)


def test_statements_quote_schema_and_table() -> None:
    s = Statements("app.events")
    assert 'UPDATE "app"."events" AS o' in s.claim_batch
    assert '"app"."outboxkit_schema_versions"' in s.create_version_table


def test_claim_is_one_statement_with_skip_locked_and_a_lease() -> None:
    claim = Statements().claim_batch
    assert claim.count(";") == 0
    assert "FOR UPDATE SKIP LOCKED" in claim
    assert "available_at = now() + make_interval" in claim
    assert "claim_token = %(token)s" in claim


def test_settle_statements_are_fenced_by_the_claim_token() -> None:
    s = Statements()
    for stmt in (
        s.settle_published_delete,
        s.settle_published_keep,
        s.settle_failures,
        s.release_leases,
    ):
        assert "claim_token = %s" in stmt


def test_numbered_placeholders_for_asyncpg() -> None:
    assert numbered("VALUES (%s, %s, %s::jsonb)") == "VALUES ($1, $2, $3::jsonb)"


def test_channel_names_fit_postgres_limits() -> None:
    assert channel_for("outbox") == "outboxkit_outbox"
    assert len(channel_for("s" * 63 + "." + "t" * 63)) <= 63


def test_print_sql_ddl_has_partial_index_autovacuum_and_version_record() -> None:
    ddl = Statements("outbox").ddl()
    assert "WHERE status = 0" in ddl
    assert "autovacuum_vacuum_scale_factor = 0" in ddl
    assert "outboxkit_schema_versions" in ddl


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("7d", 604800), ("12h", 43200), ("1h30m", 5400), ("90s", 90), ("2w", 1209600)],
)
def test_durations_parse(text: str, seconds: int) -> None:
    assert parse_duration(text) == dt.timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "7", "1x", "h", "1h 2q"])
def test_bad_durations_say_how_to_write_one(text: str) -> None:
    with pytest.raises(click.BadParameter, match="units w d h m s"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("postgresql://app:s3cr3t@db:5432/shop", "s3cr3t"),
        ("host=db user=app password=s3cr3t dbname=shop", "s3cr3t"),
        ("host=db password='s3 cr3t' dbname=shop", "s3 cr3t"),
        ("amqp://guest:pa@ss@rabbit/", "pa@ss"),
    ],
)
def test_redact_masks_passwords(text: str, secret: str) -> None:
    assert secret not in redact(text)


def test_events_attached_to_a_statement_come_first_in_text_and_parameters() -> None:
    event = Event(topic="orders", event_type="order.placed", payload={"id": 1}, key="k")
    plain_stmt, plain_params = Outbox(notify=False)._attached(
        "INSERT INTO orders (c) VALUES (%s)", ("ada",), [event]
    )
    assert plain_stmt.startswith('WITH outboxkit_events AS (INSERT INTO "outbox"')
    assert plain_stmt.endswith(")\nINSERT INTO orders (c) VALUES (%s)")
    assert plain_params == [*plain_params[:11], "ada"]  # the event's eleven columns, then yours
    assert plain_params[0] == event.event_id
    assert "pg_notify" not in plain_stmt

    merged, params = Outbox()._attached(
        "  with recursive n AS (SELECT %s) SELECT * FROM n", (7,), [event, event]
    )
    assert merged.startswith("  with recursive outboxkit_events AS (INSERT")
    assert "THEN pg_notify(%s, '') END)," in merged  # gated: only while a relay waits
    assert merged.endswith(",\nn AS (SELECT %s) SELECT * FROM n")
    assert params[-2:] == ["outboxkit_outbox", 7]
    assert params[0] == [event.event_id, event.event_id]
    assert merged.count("%s") == len(params)


def test_attaching_no_events_leaves_the_statement_alone() -> None:
    assert Outbox()._attached("SELECT %s", [1], []) == ("SELECT %s", [1])


def test_events_attached_for_asyncpg_are_numbered_after_the_callers_parameters() -> None:
    event = Event(topic="orders", event_type="order.placed", payload={"id": 1})
    stmt, params = Outbox()._attached(
        "UPDATE stock SET qty = qty - $2 WHERE sku = $1", (7, 1), [event], dollar=True
    )
    assert stmt.startswith('WITH outboxkit_events AS (INSERT INTO "outbox"')
    assert (
        "VALUES ($3::uuid, $4::text, $5::text, $6::text, $7::text, $8::text, $9::bytea,"
        " coalesce($10::jsonb, '{}'::jsonb), $11::timestamptz, $12::text,"
        " coalesce($13::timestamptz, now()))"
        " RETURNING CASE WHEN NOT pg_try_advisory_xact_lock_shared("
    ) in stmt
    assert "THEN pg_notify($14, '') END)" in stmt
    assert stmt.endswith("\nUPDATE stock SET qty = qty - $2 WHERE sku = $1")
    assert params[:2] == [7, 1]
    assert params[2] == event.event_id
    assert params[-1] == "outboxkit_outbox"
    assert len(params) == 14
