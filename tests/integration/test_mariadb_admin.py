"""The operator's commands on MariaDB (status, failed, replay, discard, purge) through the
same CLI as on PostgreSQL: the same rows give the same answers on both databases."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pymysql
import pytest
from click.testing import CliRunner

from outboxkit import Event, Outbox, Relay
from outboxkit.admin import admin_for
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.ops.cli import main
from outboxkit.publishers.memory import MemoryBroker, MemoryPublisher
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import (
    DUE,
    FAILED,
    IN_FLIGHT,
    PUBLISHED_NEW,
    PUBLISHED_OLD,
    fill_mariadb,
    fill_postgres,
    mariadb_execute,
    new_database,
    scenario_events,
    tag,
)

#: Columns whose values are times of the run (they differ between the two databases).
_TIMES = {"created_at", "available_at", "occurred_at", "published_at"}


def cli(*args: str, input: str | None = None) -> Any:
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def _json(*args: str) -> Any:
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _without_times(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in _TIMES}


@pytest.fixture
def both(mariadb_server: MariaDB, db_dsn: str) -> tuple[str, str, str]:
    """A MariaDB URL and a PostgreSQL DSN holding the same rows, and their topic tag."""
    url = new_database(mariadb_server)
    t = tag()
    events = scenario_events(t)
    fill_mariadb(url, events)
    fill_postgres(db_dsn, events)
    return url, db_dsn, t


def test_status_failed_list_and_show_on_mariadb_answer_as_on_postgresql(
    both: tuple[str, str, str],
) -> None:
    url, dsn, t = both
    maria, pg = _json("status", "--dsn", url), _json("status", "--dsn", dsn)
    assert maria["oldest_pending_age_s"] == pytest.approx(pg["oldest_pending_age_s"], abs=30)
    assert 590 < maria["oldest_pending_age_s"] < 900  # the due rows' age, not the scheduled one
    for report in (maria, pg):
        for topic in report["topics"]:
            topic.pop("oldest_pending_age_s")
        report.pop("oldest_pending_age_s")
    assert maria == pg
    assert (maria["pending"], maria["in_flight"], maria["failed"], maria["published"]) == (
        len(DUE) + 1,
        len(IN_FLIGHT),
        len(FAILED),
        len(PUBLISHED_OLD + PUBLISHED_NEW),
    )
    assert maria["blocked_keys"] == []
    maria_failed = _json("failed", "list", "--dsn", url)
    pg_failed = _json("failed", "list", "--dsn", dsn)
    assert [_without_times(r) for r in maria_failed] == [_without_times(r) for r in pg_failed]
    assert [r["id"] for r in maria_failed] == list(FAILED)
    event_id = maria_failed[0]["event_id"]
    for ref in (str(FAILED[0]), event_id):
        shown = _json("failed", "show", ref, "--dsn", url)
        assert _without_times(shown) == _without_times(_json("failed", "show", ref, "--dsn", dsn))
        assert shown["status"] == "failed" and shown["headers"] == {"h": "0"}
    # The live reading (gauges, dashboard): the same counts per topic, and the same age.
    maria_live, pg_live = admin_for(url).live_status(url), admin_for(dsn).live_status(dsn)
    for m, p in zip(maria_live.status.topics, pg_live.status.topics, strict=True):
        counts = ("topic", "pending", "in_flight", "failed")
        assert [getattr(m, c) for c in counts] == [getattr(p, c) for c in counts]
        assert (m.oldest_pending_age_s is None) == (p.oldest_pending_age_s is None)
        if m.oldest_pending_age_s is not None:
            assert m.oldest_pending_age_s == pytest.approx(p.oldest_pending_age_s, abs=30)
    assert maria_live.last_id == pg_live.last_id == 10
    table = cli("status", "--dsn", url)
    assert table.exit_code == 0 and f"{t}.mail" in table.output
    assert "dead letters present" in table.output


def test_replay_and_discard_on_mariadb_touch_failed_rows_only(
    mariadb_server: MariaDB,
) -> None:
    url = new_database(mariadb_server)
    t = tag()
    fill_mariadb(url, scenario_events(t))
    # A pending row is no dead letter: neither command touches it, and says so (exit 1).
    for args in (("replay",), ("failed", "discard")):
        refused = cli(*args, "--dsn", url, "--id", str(DUE[0]))
        assert refused.exit_code == 1 and "no failed event with id" in refused.output
    event_id = mariadb_execute(url, "SELECT event_id FROM outbox WHERE id = %s", (FAILED[0],))
    replayed = cli("replay", "--dsn", url, "--id", event_id[0][0])  # by event id
    assert replayed.exit_code == 0 and "1 event(s) back to pending" in replayed.output
    rows = mariadb_execute(
        url, "SELECT status, attempts, claim_token FROM outbox WHERE id = %s", (FAILED[0],)
    )
    assert rows == [(0, 0, None)]
    discarded = cli("failed", "discard", "--dsn", url, "--topic", f"{t}.mail", "--yes")
    assert discarded.exit_code == 0 and "discarded 1 failed event(s)" in discarded.output
    assert mariadb_execute(url, "SELECT id FROM outbox WHERE id = %s", (FAILED[1],)) == []
    left = mariadb_execute(url, "SELECT COUNT(*) FROM outbox")[0][0]
    assert left == 10 - 1  # only the one dead letter left the table
    # --all-failed with nothing failed left: exit 1, not a silent success.
    assert cli("replay", "--dsn", url, "--all-failed").exit_code == 1


def test_purge_on_mariadb_deletes_old_published_rows_only_in_batches(
    mariadb_server: MariaDB,
) -> None:
    url = new_database(mariadb_server, inbox=True)
    fill_mariadb(url, scenario_events(tag()))
    old = "(%s, 'p', 'x', '', '{}', 1, UTC_TIMESTAMP(6) - INTERVAL 2 DAY)"
    mariadb_execute(  # more old published rows than one batch
        url,
        "INSERT INTO outbox (event_id, topic, event_type, payload, headers, status,"
        " published_at) VALUES " + ", ".join([old] * 7),
        [f"00000000-0000-7000-8000-{i:012d}" for i in range(7)],
    )
    done = _json("purge", "--dsn", url, "--older-than", "1d", "--batch-size", "3")
    assert done == {"deleted": len(PUBLISHED_OLD) + 7}
    states = mariadb_execute(url, "SELECT status, COUNT(*) FROM outbox GROUP BY status")
    assert dict(states) == {0: len(DUE) + 2, 1: len(PUBLISHED_NEW), 2: len(FAILED)}
    mariadb_execute(
        url,
        "INSERT INTO processed_events (consumer_name, event_id, processed_at) VALUES"
        " ('a', 'e1', UTC_TIMESTAMP(6) - INTERVAL 10 DAY),"
        " ('b', 'e1', UTC_TIMESTAMP(6) - INTERVAL 10 DAY), ('a', 'e2', UTC_TIMESTAMP(6))",
    )
    inbox = _json("purge", "--dsn", url, "--inbox", "--older-than", "7d", "--consumer", "a")
    assert inbox == {"deleted": 1}
    left = mariadb_execute(url, "SELECT consumer_name, event_id FROM processed_events")
    assert sorted(left) == [("a", "e2"), ("b", "e1")]
    shown = cli("purge", "--dsn", url, "--older-than", "1d")
    assert shown.exit_code == 0 and "deleted 0 published row(s)" in shown.output


def test_admin_on_mariadb_says_which_table_is_missing_and_when_the_server_is_down(
    mariadb_server: MariaDB,
) -> None:
    url = new_database(mariadb_server)
    missing = cli("status", "--dsn", url, "--table", "nope")
    assert missing.exit_code == 2
    assert "outbox table 'nope' does not exist" in missing.output
    assert "outboxkit migrate" in missing.output
    board = cli("dashboard", "--dsn", url, "--table", "nope")  # refused before serving
    assert board.exit_code == 2 and "outbox table 'nope' does not exist" in board.output
    inbox = cli("purge", "--dsn", url, "--inbox", "--inbox-table", "nope", "--older-than", "1d")
    assert inbox.exit_code == 2 and "inbox table 'nope' not found" in inbox.output
    secret = "s3cr3t-pw"
    down = url.replace("root@", f"root:{secret}@").rsplit(":", 1)[0] + ":1/x"
    gone = cli("failed", "list", "--dsn", down)
    assert gone.exit_code == 3 and "cannot reach MariaDB" in gone.output
    assert secret not in gone.output
    assert admin_for(url).name == "mariadb" and admin_for("postgresql:///x").name == "postgresql"


async def test_relay_retention_keep_on_mariadb_leaves_rows_that_status_counts_and_purge_removes(
    mariadb_server: MariaDB,
) -> None:
    url = new_database(mariadb_server)
    t = tag()
    conn = pymysql.connect(**connect_args(url))
    try:
        events = [Event(topic=f"{t}.kept", event_type="x", payload={"n": i}) for i in range(5)]
        Outbox(storage="mariadb").put_many(conn, events)
        conn.commit()
    finally:
        conn.close()
    broker = MemoryBroker(f"{t}-broker")
    relay = Relay(url, MemoryPublisher(broker), retention="keep", poll_interval=0.05)
    running = asyncio.create_task(relay.run())
    try:
        async with asyncio.timeout(20):
            while _json("status", "--dsn", url)["published"] < 5:
                await asyncio.sleep(0.05)
    finally:
        relay.stop()
        await running
    assert _json("status", "--dsn", url)["pending"] == 0
    assert len(broker.on(f"{t}.kept")) == 5
    assert _json("purge", "--dsn", url, "--older-than", "0s") == {"deleted": 5}
    assert mariadb_execute(url, "SELECT COUNT(*), MAX(id) FROM outbox") == [(0, None)]
    # MAX(id) went back to nothing as the rows left; the dashboard's throughput reads the
    # last id handed out instead, which stays at the 5 events written.
    assert admin_for(url).live_status(url).last_id == 5


def test_blocked_keys_of_an_ordered_table_are_the_same_on_both_databases(
    mariadb_server: MariaDB, db_dsn: str
) -> None:
    """A key whose head event was dead-lettered stops (ordered mode, policy ``block``): both
    databases name it, its head and the events waiting behind it; a key whose dead letter has
    nothing behind it, and a table that is not ordered, list nothing."""
    url = new_database(mariadb_server)
    assert admin_for(url).blocked_keys(url) == []  # not ordered: dead letters block nothing
    for dsn in (url, db_dsn):
        assert cli("migrate", "--dsn", dsn, "--ordered").exit_code == 0
    t = tag()
    events = [
        Event(topic=f"{t}.orders", event_type="order.placed", key=key, payload={"n": n})
        for n, key in enumerate(["a", "b", "a", "a", "b"])
    ]
    conn = pymysql.connect(**connect_args(url))
    Outbox(storage="mariadb", ordered=True).put_many(conn, events)
    conn.commit()
    conn.close()
    import psycopg

    with psycopg.connect(db_dsn) as pg:
        Outbox(ordered=True).put_many(pg, events)
    dead = "UPDATE outbox SET status = 2, attempts = 3, last_error = 'refused' WHERE id IN (1, 5)"
    mariadb_execute(url, dead)
    with psycopg.connect(db_dsn, autocommit=True) as pg:
        pg.execute(dead)
    found = {
        name: [_without_times(r) for r in admin_for(dsn).blocked_keys(dsn)]
        for name, dsn in (("mariadb", url), ("postgres", db_dsn))
    }
    assert found["mariadb"] == found["postgres"]
    [row] = found["mariadb"]
    assert (row["key"], row["id"], row["waiting"], row["last_error"]) == ("a", 1, 2, "refused")
    assert row["event_id"] == events[0].event_id
