"""A partitioned outbox (migrate --partition-by): structure, writes, maintenance, relay, CLI.

Also runs the key cases of test_write.py, test_write_commit.py and test_relay.py against a
partitioned table (their ``db_dsn`` is overridden below): every write path and the polling
relay work unchanged on it. Run it against the machine's PostgreSQL 15
(OUTBOXKIT_TEST_DSN) and the embedded one (18) to cover both.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from outboxkit import Event, Outbox, SchemaError
from outboxkit.backends.postgres import partitions as P
from outboxkit.backends.postgres.migrate import MigrationAction, migrate
from outboxkit.backends.postgres.postgres import SCHEMA_VERSION
from outboxkit.maintenance import side_task as maintenance
from outboxkit.ops.cli import main
from outboxkit.publishers.base import OutboundMessage, Publisher, PublishResult
from outboxkit.testing import create_database, drop_database
from tests.integration import test_relay as _relay
from tests.integration import test_write as _write
from tests.integration import test_write_commit as _commit
from tests.integration.test_write import shop_dsn as shop_dsn  # the fixture, on db_dsn below
from tests.support.relaying import count, running_relay, wait_for
from tests.support.servers import unique_name


@pytest.fixture
def db_dsn(pg_server: Any) -> Iterator[str]:
    """A fresh database whose `outbox` is partitioned by day (overrides conftest's)."""
    name = unique_name("test")
    create_database(pg_server.dsn, name)
    dsn = pg_server.dsn_for(name)
    migrate(dsn, table="outbox", partition_by="day")
    yield dsn
    drop_database(pg_server.dsn, name)


# -- the existing write and relay cases, on a partitioned table ---------------------------

test_order_row_and_outbox_row_commit_together = _write.test_order_row_and_outbox_row_commit_together
test_rollback_after_put_leaves_neither_order_nor_event = (
    _write.test_rollback_after_put_leaves_neither_order_nor_event
)
test_put_many_keeps_the_order_of_the_events = _write.test_put_many_keeps_the_order_of_the_events
test_put_many_is_one_round_trip_however_many_events = (
    _write.test_put_many_is_one_round_trip_however_many_events
)
test_psycopg_async_adapter = _write.test_psycopg_async_adapter
test_asyncpg_adapter = _write.test_asyncpg_adapter
test_sqlalchemy_session_and_connection_adapters = (
    _write.test_sqlalchemy_session_and_connection_adapters
)
test_execute_with_writes_the_events_in_the_callers_statement = (
    _write.test_execute_with_writes_the_events_in_the_callers_statement
)
test_execute_with_rolls_back_with_the_transaction = (
    _write.test_execute_with_rolls_back_with_the_transaction
)
test_aexecute_with_on_asyncpg_numbers_the_events_after_the_callers_parameters = (
    _write.test_aexecute_with_on_asyncpg_numbers_the_events_after_the_callers_parameters
)
test_events_put_in_an_outbox_transaction_commit_with_the_business_change = (
    _commit.test_events_put_in_an_outbox_transaction_commit_with_the_business_change
)
test_the_events_ride_the_commits_round_trip = _commit.test_the_events_ride_the_commits_round_trip
test_an_exception_in_the_block_rolls_back_and_sends_no_event = (
    _commit.test_an_exception_in_the_block_rolls_back_and_sends_no_event
)
test_async_outbox_transaction_commits_and_rolls_back = (
    _commit.test_async_outbox_transaction_commits_and_rolls_back
)
test_committed_events_arrive_at_kafka_with_key_headers_and_payload_bytes = (
    _relay.test_committed_events_arrive_at_kafka_with_key_headers_and_payload_bytes
)
test_committed_events_arrive_at_nats_jetstream_with_msg_id_and_payload_bytes = (
    _relay.test_committed_events_arrive_at_nats_jetstream_with_msg_id_and_payload_bytes
)
test_concurrent_claims_never_return_the_same_row = (
    _relay.test_concurrent_claims_never_return_the_same_row
)
test_several_relays_on_one_table_publish_each_event_exactly_once = (
    _relay.test_several_relays_on_one_table_publish_each_event_exactly_once
)
test_publish_failure_is_recorded_retried_then_dead_lettered_and_later_events_flow = (
    _relay.test_publish_failure_is_recorded_retried_then_dead_lettered_and_later_events_flow
)
test_keep_retention_marks_rows_published_instead_of_deleting = (
    _relay.test_keep_retention_marks_rows_published_instead_of_deleting
)


# -- helpers ------------------------------------------------------------------------------

TODAY = P.period_start(dt.datetime.now(dt.UTC), "day")


def _event(i: int = 0, topic: str = "orders") -> Event:
    return Event(topic=topic, event_type="order.placed", payload={"order": i}, key=f"k{i % 3}")


def _insert_at(dsn: str, created_at: dt.datetime, status: int = 0, n: int = 1) -> None:
    """Rows with a chosen created_at (plain SQL: Event does not set it)."""
    with psycopg.connect(dsn) as conn:
        for _ in range(n):
            conn.execute(
                "INSERT INTO outbox (event_id, topic, event_type, payload, created_at, status)"
                " VALUES (%s, 'orders', 'x', '\\x00', %s, %s)",
                (uuid.uuid4(), created_at, status),
            )


def _where(dsn: str) -> dict[str, int]:
    """Rows per partition."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT tableoid::regclass::text, count(*) FROM outbox GROUP BY 1"
        ).fetchall()
    return {name: int(n) for name, n in found}


def _partition_names(dsn: str) -> list[str]:
    return [i.name for i in P.list_partitions(dsn)]


def _day(offset: int) -> str:
    return P.partition_name("outbox", TODAY + dt.timedelta(days=offset), "day")


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


# -- migrate ------------------------------------------------------------------------------


def test_migrate_creates_a_range_partitioned_outbox_like_the_plain_one(db_dsn: str) -> None:
    migrate(db_dsn, table="plain")
    with psycopg.connect(db_dsn, autocommit=True) as conn:

        def columns(table: str) -> list[tuple[Any, ...]]:
            return conn.execute(
                "SELECT column_name, data_type, is_nullable, column_default, is_identity"
                " FROM information_schema.columns WHERE table_name = %s ORDER BY ordinal_position",
                (table,),
            ).fetchall()

        assert columns("outbox") == columns("plain")
        kind, key = conn.execute(
            "SELECT relkind, pg_get_partkeydef(oid) FROM pg_class WHERE relname = 'outbox'"
        ).fetchone() or (None, None)
        assert (kind, key) == ("p", "RANGE (created_at)")
        pk = conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'outbox'::regclass AND contype = 'p'"
        ).fetchone()
        assert pk == ("PRIMARY KEY (id, created_at)",)
        # every partition has the three partial indexes and the queue-table autovacuum settings
        for name in [_day(0), _day(3), "outbox_default"]:
            preds = conn.execute(
                "SELECT pg_get_expr(indpred, indrelid) FROM pg_index"
                " WHERE indrelid = %s::regclass AND indpred IS NOT NULL ORDER BY 1",
                (name,),
            ).fetchall()
            assert [p for (p,) in preds] == ["(status = 0)", "(status = 1)", "(status = 2)"]
            (options,) = conn.execute(
                "SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (name,)
            ).fetchone() or (None,)
            assert "autovacuum_vacuum_threshold=5000" in options
        version = conn.execute(
            "SELECT version FROM outboxkit_schema_versions WHERE table_name = 'outbox'"
        ).fetchone()
        assert version == (SCHEMA_VERSION,)
    # the default partition, today and 3 days ahead
    assert _partition_names(db_dsn) == [_day(0), _day(1), _day(2), _day(3), "outbox_default"]
    again = migrate(db_dsn, table="outbox", partition_by="day")
    assert again.action is MigrationAction.UNCHANGED
    assert "partitions in place" in again.describe()
    assert migrate(db_dsn, table="outbox").action is MigrationAction.UNCHANGED
    with pytest.raises(SchemaError, match="partitioned by day, not hour"):
        migrate(db_dsn, table="outbox", partition_by="hour")


def test_migrate_refuses_to_convert_a_plain_table_holding_rows(empty_db_dsn: str) -> None:
    migrate(empty_db_dsn, table="outbox")
    with psycopg.connect(empty_db_dsn) as conn:
        Outbox().put(conn, _event())
    with pytest.raises(SchemaError, match="not partitioned and holds rows.*docs/operations.md"):
        migrate(empty_db_dsn, table="outbox", partition_by="day")
    assert count(empty_db_dsn) == 1  # untouched
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox")
    # an empty plain table is replaced
    result = migrate(empty_db_dsn, table="outbox", partition_by="day")
    assert "partitioned by day" in result.describe()
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        assert P.is_partitioned(conn, "outbox") is True


def test_migrate_partitions_a_schema_qualified_table_by_hour(empty_db_dsn: str) -> None:
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA events")
    migrate(empty_db_dsn, table="events.outbox", partition_by="hour")
    names = [i.name for i in P.list_partitions(empty_db_dsn, "events.outbox")]
    hour = P.period_start(dt.datetime.now(dt.UTC), "hour")
    assert names[0] == "events." + P.partition_name("outbox", hour, "hour")
    assert len(names) == 5 and names[-1] == "events.outbox_default"
    with psycopg.connect(empty_db_dsn) as conn:
        Outbox("events.outbox").put(conn, _event())
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        (where,) = conn.execute(
            "SELECT tableoid::regclass::text FROM events.outbox"
        ).fetchone() or (None,)
    assert where in (names[0], names[1])  # this hour (or the next, at the turn of the hour)


# -- writes and stray rows -----------------------------------------------------------------


def test_writes_land_in_the_partition_of_their_created_at(db_dsn: str) -> None:
    with psycopg.connect(db_dsn) as conn:
        Outbox().put_many(conn, [_event(i) for i in range(3)])
    _insert_at(db_dsn, TODAY + dt.timedelta(days=2, hours=5))
    now = P.period_start(dt.datetime.now(dt.UTC), "day")
    assert now == TODAY, "the test ran across midnight UTC"
    assert _where(db_dsn) == {_day(0): 3, _day(2): 1}


def test_a_row_no_partition_covers_lands_in_the_default_partition_loudly_then_moves(
    db_dsn: str,
) -> None:
    # the maintenance stopped for days: rows of a day with no partition yet
    late = TODAY + dt.timedelta(days=9, hours=1)
    _insert_at(db_dsn, late, n=2)
    _insert_at(db_dsn, TODAY - dt.timedelta(days=2), status=1)
    assert _where(db_dsn) == {"outbox_default": 3}
    listed = _cli("partitions", "list", "--dsn", db_dsn)
    assert listed.exit_code == 0
    assert "3 row(s) in the default partition" in listed.stderr
    assert P.stray_rows(db_dsn) == 3
    status = _cli("status", "--dsn", db_dsn)
    assert "rows outside every partition: 3 in the default partition" in status.stdout
    report = P.maintain(db_dsn)
    assert report.moved_rows == 3 and report.stray_rows == 0
    assert _where(db_dsn) == {_day(9): 2, _day(-2): 1}
    assert count(db_dsn, "status = 0") == 2  # moved rows keep their columns
    # within the window it stays; with a 1-day window the day of the published row goes
    assert P.maintain(db_dsn).dropped == []
    assert P.maintain(db_dsn, keep=dt.timedelta(days=1)).dropped == [_day(-2)]


# -- maintenance ---------------------------------------------------------------------------


def test_maintenance_creates_partitions_ahead_as_time_passes(db_dsn: str) -> None:
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)
    report = P.maintain(db_dsn, now=later)
    assert report.created == [_day(4), _day(5)]
    assert report.dropped == [] and report.skipped is None
    assert P.maintain(db_dsn, now=later).created == []  # idempotent
    report = P.maintain(db_dsn, now=later, ahead=5)
    assert report.created == [_day(6), _day(7)]


def test_an_expired_partition_is_dropped_only_when_every_row_is_published(db_dsn: str) -> None:
    _insert_at(db_dsn, TODAY + dt.timedelta(hours=1), status=1, n=50)  # all published
    _insert_at(db_dsn, TODAY + dt.timedelta(days=1), status=1, n=5)
    _insert_at(db_dsn, TODAY + dt.timedelta(days=1, hours=2), status=2)  # a dead letter
    _insert_at(db_dsn, TODAY + dt.timedelta(days=2), status=1, n=5)
    _insert_at(db_dsn, TODAY + dt.timedelta(days=2, hours=3), status=0)  # still pending
    _insert_at(db_dsn, TODAY + dt.timedelta(days=3), status=1)  # not expired yet
    # ten days on, with the default 7-day window: day 0-2 are expired, day 3 is not
    report = P.maintain(db_dsn, now=TODAY + dt.timedelta(days=10))
    assert report.dropped == [_day(0)]
    assert [(k.name, k.pending, k.failed) for k in report.kept] == [
        (_day(1), 0, 1),
        (_day(2), 1, 0),
    ]
    assert "dead letter" in report.kept[0].reason
    assert _day(0) not in _partition_names(db_dsn)
    assert _where(db_dsn)[_day(3)] == 1
    # a shorter window reaches day 3; replayed and published, the dead letter's day goes too
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET status = 1 WHERE status <> 1")
    report = P.maintain(db_dsn, now=TODAY + dt.timedelta(days=10), keep=dt.timedelta(days=6))
    assert report.dropped == [_day(1), _day(2), _day(3)] and report.kept == []


def test_a_relay_that_never_updates_rows_drops_what_its_stream_confirmed(db_dsn: str) -> None:
    """The WAL relay's table source: rows stay pending; its confirmed commit time decides."""
    _insert_at(db_dsn, TODAY + dt.timedelta(hours=1), n=3)  # pending forever
    _insert_at(db_dsn, TODAY + dt.timedelta(days=1, hours=1), n=2)
    _insert_at(db_dsn, TODAY + dt.timedelta(days=1, hours=2), status=2)  # its dead letter
    later = TODAY + dt.timedelta(days=9)
    # confirmed only up to the middle of day 0: nothing goes
    report = P.maintain(db_dsn, now=later, confirmed_through=TODAY + dt.timedelta(hours=12))
    assert report.dropped == []
    report = P.drop_published_partitions(
        db_dsn, "outbox", confirmed_through=TODAY + dt.timedelta(days=2, hours=1)
    )
    assert report.dropped == []  # not 7 days old yet, by the real clock
    report = P.maintain(db_dsn, now=later, confirmed_through=TODAY + dt.timedelta(days=2))
    assert report.dropped == [_day(0)]
    assert [(k.name, k.failed) for k in report.kept] == [(_day(1), 1)]


def test_only_one_maintenance_runs_at_a_time(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (P._lock_key("outbox"),))
        report = P.maintain(db_dsn, now=TODAY + dt.timedelta(days=3))
        assert report.skipped and "another maintenance" in report.skipped
        assert report.created == []
        out = _cli("partitions", "maintain", "--dsn", db_dsn)
        assert "nothing done: another maintenance" in out.stdout
    assert P.maintain(db_dsn, now=TODAY + dt.timedelta(days=3)).created != []


def test_a_busy_table_defers_the_drop_instead_of_queueing_writers(db_dsn: str) -> None:
    _insert_at(db_dsn, TODAY + dt.timedelta(hours=1), status=1)
    with psycopg.connect(db_dsn) as writer:  # a long transaction holding the outbox
        writer.execute("SELECT 1 FROM outbox LIMIT 1")
        report = P.maintain(
            db_dsn, now=TODAY + dt.timedelta(days=9), lock_timeout=dt.timedelta(milliseconds=200)
        )
        assert report.dropped == [] and {_day(0), _day(1)} <= set(report.deferred)
    report = P.maintain(db_dsn, now=TODAY + dt.timedelta(days=9))
    assert report.dropped == [_day(0), _day(1)] and report.deferred == []


def test_a_plain_table_is_refused_by_the_partition_commands(empty_db_dsn: str) -> None:
    migrate(empty_db_dsn, table="outbox")
    out = _cli("partitions", "maintain", "--dsn", empty_db_dsn)
    assert out.exit_code == 2
    assert "is not partitioned" in out.stderr and "--partition-by" in out.stderr


# -- the relay ------------------------------------------------------------------------------


class _Collect(Publisher):
    name = "collect"

    def __init__(self) -> None:
        self.seen: list[OutboundMessage] = []

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        self.seen.extend(messages)
        return [PublishResult.success()] * len(messages)


async def test_the_relay_maintains_partitions_and_drops_what_it_published(
    empty_db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hourly partitions, a 1-hour window: rows of 3 hours ago (in the default partition,
    as after a stopped maintenance) are moved into their partition, published (keep), and
    the partition is dropped by the relay's own maintenance."""
    dsn = empty_db_dsn
    migrate(dsn, table="outbox", partition_by="hour")
    P.update_settings(dsn, keep=dt.timedelta(hours=1))
    past = dt.datetime.now(dt.UTC) - dt.timedelta(hours=3)
    old = P.partition_name("outbox", P.period_start(past, "hour"), "hour")
    _insert_at(dsn, past, n=20)
    monkeypatch.setattr(maintenance, "INTERVAL", 0.3)
    publisher = _Collect()
    async with running_relay(dsn, publisher, retention="keep"):
        await wait_for(lambda: len(publisher.seen) >= 20, what="the old rows published")
        await wait_for(
            lambda: old not in _partition_names(dsn) and count(dsn) == 0,
            what=f"{old} dropped by the relay",
        )
        # a partition ahead dropped by hand comes back
        ahead = _partition_names(dsn)[-2]
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP TABLE "{ahead}"')
        await wait_for(lambda: ahead in _partition_names(dsn), what="the partition recreated")
    assert P.stray_rows(dsn) == 0


async def test_a_relay_does_not_maintain_while_another_holds_the_lock(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(maintenance, "INTERVAL", 0.2)
    ahead = _day(3)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE "{ahead}"')
    with psycopg.connect(db_dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (P._lock_key("outbox"),))
        async with running_relay(db_dsn, _Collect(), retention="keep"):
            await asyncio.sleep(1.5)  # several maintenance rounds, all skipped
            assert ahead not in _partition_names(db_dsn)
            holder.execute("SELECT pg_advisory_unlock(%s)", (P._lock_key("outbox"),))
            await wait_for(lambda: ahead in _partition_names(db_dsn), what="maintenance resumed")


async def test_a_relay_on_a_plain_table_runs_no_maintenance(empty_db_dsn: str) -> None:
    migrate(empty_db_dsn, table="outbox")
    with psycopg.connect(empty_db_dsn) as conn:
        Outbox().put(conn, _event())
    async with running_relay(empty_db_dsn, _Collect()) as relay:
        await wait_for(lambda: count(empty_db_dsn) == 0, what="drained")

        def maintaining() -> bool:
            return any(
                t.get_name() == "outboxkit-relay:time-partitions" for t in asyncio.all_tasks()
            )

        await wait_for(lambda: not maintaining(), what="the maintenance task ended")
        assert not relay.stopping  # its end stopped nothing


# -- CLI --------------------------------------------------------------------------------------


def test_partitions_list_shows_each_partition_as_a_table_and_as_json(db_dsn: str) -> None:
    with psycopg.connect(db_dsn) as conn:
        Outbox().put_many(conn, [_event(i) for i in range(4)])
    _insert_at(db_dsn, TODAY + dt.timedelta(hours=1), status=2)
    out = _cli("partitions", "list", "--dsn", db_dsn, "--exact")
    assert out.exit_code == 0
    lines = out.stdout.splitlines()
    header = next(line for line in lines if "partition" in line and "pending" in line)
    for col in ("partition", "range", "rows", "pending", "failed", "size"):
        assert col in header
    today = next(line for line in lines if _day(0) in line).replace("│", " ").split()
    assert today[-5:-2] == ["5", "4", "1"]  # rows, pending, failed (then the size)
    assert "DEFAULT" in out.stdout
    data = json.loads(_cli("partitions", "list", "--dsn", db_dsn, "--json").stdout)
    first = data[0]
    assert first["name"] == _day(0)
    assert (first["pending"], first["failed"]) == (4, 1)
    assert first["lower"] == TODAY.isoformat() and not first["default"]
    assert data[-1]["default"] and data[-1]["rows"] == 0
    assert {"rows", "rows_exact", "size_bytes", "upper"} <= set(first)


def test_partitions_maintain_reports_in_text_and_json(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(f'DROP TABLE "{_day(2)}"')
    out = _cli("partitions", "maintain", "--dsn", db_dsn)
    assert out.exit_code == 0
    assert "created 1 partition(s), dropped 0" in out.stdout and f"+ {_day(2)}" in out.stdout
    set_out = _cli("partitions", "set", "--dsn", db_dsn, "--keep", "2d", "--ahead", "4")
    assert "keep 2 days" in set_out.stdout
    report = json.loads(_cli("partitions", "maintain", "--dsn", db_dsn, "--json").stdout)
    assert report["created"] == [_day(4)] and report["dropped"] == []
    assert report["skipped"] is None and report["stray_rows"] == 0
    assert (
        P.PartitionSettings.from_comment(json.dumps({})) is None
    )  # a foreign comment is not settings


def test_migrate_cli_creates_a_partitioned_table_and_prints_its_ddl(empty_db_dsn: str) -> None:
    out = _cli("migrate", "--dsn", empty_db_dsn, "--partition-by", "day")
    assert out.exit_code == 0 and "partitioned by day, created outbox_default" in out.stdout
    ddl = _cli("migrate", "--print-sql", "--partition-by", "hour").stdout
    assert "PARTITION BY RANGE (created_at)" in ddl and "PARTITION OF" in ddl
    name = unique_name("ddl")
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
        conn.execute(f"SET search_path = {name}")
        conn.execute(ddl)  # the printed script runs as is
        assert P.is_partitioned(conn, f"{name}.outbox") is True
