"""`outboxkit cdc setup | status | drop` and the slot checks, on real PostgreSQL servers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import psycopg
import pytest
from click.testing import CliRunner

from outboxkit import Event, Outbox
from outboxkit.cdc import slots
from outboxkit.cdc.errors import CdcSetupError, SlotInvalidated
from outboxkit.cdc.stream import Commit, ReplicationStream
from outboxkit.ops.cli import main
from outboxkit.testing import EmbeddedPostgres, EmbeddedServerUnavailable
from tests.support.servers import require_or_skip


def _write(dsn: str, count: int) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for i in range(count):
            Outbox().put(conn, Event(topic="orders", event_type="placed", payload={"i": i}))


def _catalog(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM pg_publication),"
            " (SELECT count(*) FROM pg_replication_slots)"
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def test_setup_on_a_replica_level_server_explains_what_to_change_and_changes_nothing(
    db_dsn: str,
) -> None:
    # The session's server: the embedded one runs with wal_level=replica, as does the
    # machine's (OUTBOXKIT_TEST_DSN) in CI; only a read-only check runs against it.
    with psycopg.connect(db_dsn, autocommit=True, connect_timeout=3) as conn:
        level = conn.execute("SHOW wal_level").fetchone()
    if level == ("logical",):
        pytest.skip("this server already has wal_level=logical")
    before = _catalog(db_dsn)
    with pytest.raises(CdcSetupError) as failure:
        slots.setup(db_dsn, "outbox")
    message = str(failure.value)
    assert f"wal_level is {level[0]!r}" in message
    assert "set wal_level = logical in postgresql.conf" in message
    assert "ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL" in message
    result = CliRunner().invoke(main, ["cdc", "setup", "--dsn", db_dsn])
    assert result.exit_code == 2
    assert "restart PostgreSQL" in result.output
    assert _catalog(db_dsn) == before  # no publication, no slot left behind


def test_setup_creates_publication_and_slot_once_and_drop_removes_both(
    logical_db_dsn: str,
) -> None:
    result = slots.setup(logical_db_dsn, "outbox")
    assert result.created_publication and result.created_slot
    assert (result.slot, result.publication) == ("outboxkit_outbox", "outboxkit_outbox")
    again = slots.setup(logical_db_dsn, "outbox")
    assert not again.created_publication and not again.created_slot
    with psycopg.connect(logical_db_dsn) as conn:
        pub = conn.execute(
            "SELECT pubinsert, pubupdate, pubdelete FROM pg_publication WHERE pubname = %s",
            (result.publication,),
        ).fetchone()
        slot = conn.execute(
            "SELECT plugin, slot_type FROM pg_replication_slots WHERE slot_name = %s",
            (result.slot,),
        ).fetchone()
    assert pub == (True, False, False)  # inserts only: the relay's bulk deletes stay out
    assert slot == ("pgoutput", "logical")

    cli = CliRunner().invoke(main, ["cdc", "drop", "--dsn", logical_db_dsn])
    assert cli.exit_code == 0, cli.output
    assert "slot outboxkit_outbox dropped" in cli.output
    with psycopg.connect(logical_db_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_publication").fetchone() == (0,)
        assert conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'outboxkit_outbox'"
        ).fetchone() == (0,)
    assert not slots.drop(logical_db_dsn, "outbox").dropped_slot  # idempotent


def test_setup_without_the_table_or_replication_privilege_lists_every_fix(
    logical_db_dsn: str,
) -> None:
    with psycopg.connect(logical_db_dsn, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS cdc_plain")
        conn.execute("CREATE ROLE cdc_plain LOGIN")
    try:
        plain = logical_db_dsn.replace("postgres@", "cdc_plain@", 1)
        problems = slots.check(plain, "outbox")
        assert any("ALTER ROLE cdc_plain WITH REPLICATION" in p for p in problems)
        assert any("does not own table 'outbox'" in p for p in problems)
        with pytest.raises(CdcSetupError, match=r"\(1\) .*\(2\) "):
            slots.setup(plain, "outbox")
        assert any("outboxkit migrate" in p for p in slots.check(logical_db_dsn, "missing"))
    finally:
        with psycopg.connect(logical_db_dsn, autocommit=True) as conn:
            conn.execute("DROP ROLE cdc_plain")


async def test_status_reports_lag_in_bytes_and_seconds_until_the_relay_confirms(
    logical_db_dsn: str,
) -> None:
    slots.setup(logical_db_dsn, "outbox")
    idle = slots.status(logical_db_dsn, "outbox")
    assert idle.exists and not idle.active and idle.lag_seconds == 0.0
    assert any("max_slot_wal_keep_size = -1 (unlimited)" in note for note in idle.notes)
    _write(logical_db_dsn, 3)
    time.sleep(1.2)
    behind = slots.status(logical_db_dsn, "outbox")
    assert behind.lag_bytes is not None and behind.lag_bytes > 0
    assert behind.lag_seconds is not None and 1.0 <= behind.lag_seconds < 30
    assert behind.wal_status == "reserved" and behind.problem is None
    assert behind.oldest_unconfirmed_commit is not None

    async with ReplicationStream(logical_db_dsn, "outboxkit_outbox", "outboxkit_outbox") as s:
        async for item in s:
            if isinstance(item, Commit):
                s.confirm(item.end_lsn)
                break
        streaming = slots.status(logical_db_dsn, "outbox")
        assert streaming.active and streaming.active_pid is not None
    caught_up = slots.status(logical_db_dsn, "outbox")
    assert caught_up.lag_seconds == 0.0
    assert caught_up.lag_bytes is not None and caught_up.lag_bytes < behind.lag_bytes

    cli = CliRunner().invoke(main, ["cdc", "status", "--dsn", logical_db_dsn, "--json"])
    assert cli.exit_code == 0, cli.output
    data = json.loads(cli.output)
    assert data["exists"] and not data["invalidated"] and data["problem"] is None
    assert {"lag_bytes", "lag_seconds", "wal_status", "safe_wal_size"} <= data.keys()
    table = CliRunner().invoke(main, ["cdc", "status", "--dsn", logical_db_dsn])
    assert "lag seconds" in table.output and "confirmed flush lsn" in table.output


def test_status_of_a_missing_slot_says_to_run_setup(logical_db_dsn: str) -> None:
    cli = CliRunner().invoke(main, ["cdc", "status", "--dsn", logical_db_dsn])
    assert cli.exit_code == 2
    assert "does not exist: run `outboxkit cdc setup --table outbox`" in cli.output


@pytest.fixture
def tiny_keep_server() -> Iterator[EmbeddedPostgres]:
    """A logical server whose slots may hold at most 1 MB of WAL beyond max_wal_size."""
    try:
        server = EmbeddedPostgres(
            fsync=False,
            logical=True,
            settings={
                "max_slot_wal_keep_size": "1MB",
                "max_wal_size": "32MB",
                "min_wal_size": "32MB",
            },
        )
        server.start()
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"embedded PostgreSQL unavailable: {exc}")
    try:
        yield server
    finally:
        server.close()


async def test_an_invalidated_slot_is_reported_with_the_recovery_steps(
    tiny_keep_server: EmbeddedPostgres,
) -> None:
    from outboxkit.backends.postgres.migrate import migrate

    dsn = tiny_keep_server.dsn
    migrate(dsn, table="outbox")
    slots.setup(dsn, "outbox")
    _write(dsn, 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE filler (x text)")
        for _ in range(6):  # each round: a new WAL segment, written to, then recycled
            conn.execute(
                "INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 3000)"
            )
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
    report = slots.status(dsn, "outbox")
    assert report.wal_status == "lost" and report.invalidated
    problem = report.problem or ""
    assert "invalidated" in problem and "max_slot_wal_keep_size" in problem
    assert (
        "`outboxkit cdc drop --table outbox` then `outboxkit cdc setup --table outbox`" in problem
    )
    cli = CliRunner().invoke(main, ["cdc", "status", "--dsn", dsn])
    assert cli.exit_code == 2 and "invalidated" in cli.output
    with pytest.raises(SlotInvalidated, match="cdc drop"):
        async with ReplicationStream(dsn, "outboxkit_outbox", "outboxkit_outbox"):
            pass
    with pytest.raises(SlotInvalidated):
        slots.setup(dsn, "outbox")  # setup does not pretend an invalidated slot is fine
    slots.drop(dsn, "outbox")
    assert slots.setup(dsn, "outbox").created_slot  # the documented recovery works


async def test_relay_metrics_export_the_slot_lag_read_from_the_server(logical_db_dsn: str) -> None:
    from prometheus_client import generate_latest

    from outboxkit.backends import backend_for
    from outboxkit.ops.metrics import RelayMetrics

    slots.setup(logical_db_dsn, "outbox")
    _write(logical_db_dsn, 2)
    metrics = RelayMetrics(logical_db_dsn, process_metrics=False)
    gauges = backend_for(logical_db_dsn).gauge_reader(logical_db_dsn, "outbox")
    try:
        await metrics.refresh_slot(gauges, "outboxkit_outbox")
        text = generate_latest(metrics.registry).decode()
        assert "outboxkit_cdc_slot_invalidated 0.0" in text
        lag = next(x for x in text.splitlines() if x.startswith("outboxkit_cdc_slot_lag_bytes "))
        assert float(lag.split()[1]) > 0
        await metrics.refresh_slot(gauges, "outboxkit_missing")
    finally:
        await gauges.close()
    assert "outboxkit_cdc_slot_invalidated 1.0" in generate_latest(metrics.registry).decode()
