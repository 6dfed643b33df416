"""The inbox on the private MariaDB: each event changes the consumer's table once, through
every driver, and two consumer processes racing on the same event ids (one on PyMySQL, one
on aiomysql) apply each exactly once. `ledger` has no unique key: a double apply shows."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from outboxkit import Inbox
from outboxkit.backends.mariadb.migrate import migrate_inbox
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.events import new_event_id
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import ASYNC, SYNC, Driver, database

LEDGER = "CREATE TABLE ledger (id INT AUTO_INCREMENT PRIMARY KEY, event_id CHAR(36), amount INT)"
INSERT_LEDGER = "INSERT INTO ledger (event_id, amount) VALUES (%s, %s)"


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    """A database of this test's own: the inbox migrated (twice: idempotent) and a ledger."""
    with database(mariadb_server, "inbox", migrate_inbox, migrate_inbox) as url:
        conn = pymysql.connect(**connect_args(url), autocommit=True)
        try:
            with conn.cursor() as cur:
                cur.execute(LEDGER)
        finally:
            conn.close()
        yield url


def _ledger(url: str) -> list[tuple[Any, ...]]:
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT event_id, amount FROM ledger ORDER BY id")
            return list(cur.fetchall())
    finally:
        conn.close()


def _apply(driver: Driver, conn: Any, sql: str, params: tuple[Any, ...]) -> None:
    """The consumer's own write, in the same transaction as the inbox record."""
    if driver.name.startswith("sqlalchemy"):
        sa_conn = (
            conn.connection()
            if hasattr(conn, "connection") and driver.name.endswith("session")
            else conn
        )
        sa_conn.exec_driver_sql(sql, params)
    else:
        with conn.cursor() as cur:
            cur.execute(sql, params)


@pytest.mark.parametrize("driver", SYNC, ids=str)
def test_an_event_delivered_three_times_changes_the_table_once(url: str, driver: Driver) -> None:
    inbox, event_id, outcomes = Inbox(), new_event_id(), []
    for _ in range(3):  # a redelivery, then a relay's re-publish
        with driver.transaction(connect_args(url), url) as conn:
            with inbox.handle(conn, "billing", event_id) as fresh:
                outcomes.append(fresh)
                if fresh:
                    _apply(driver, conn, INSERT_LEDGER, (str(event_id), 42))
            assert inbox.seen(conn, "billing", event_id)
            assert not inbox.seen(conn, "shipping", event_id)
    assert outcomes == [True, False, False]
    assert _ledger(url) == [(str(event_id), 42)]


@pytest.mark.parametrize("driver", ASYNC, ids=str)
async def test_async_drivers_record_once_and_a_failed_handler_records_nothing(
    url: str, driver: Driver
) -> None:
    inbox, event_id = Inbox(), new_event_id()
    with pytest.raises(RuntimeError, match="payment service down"):
        async with driver.transaction(connect_args(url), url) as conn:
            async with inbox.ahandle(conn, "billing", event_id) as fresh:
                assert fresh
                raise RuntimeError("payment service down")
    outcomes = []
    for _ in range(2):
        async with driver.transaction(connect_args(url), url) as conn:
            outcomes.append(await inbox.amark(conn, "billing", str(event_id)))
            assert await inbox.aseen(conn, "billing", event_id)
    assert outcomes == [True, False], "the rolled-back record must not stop the retry"


def test_bad_arguments_are_refused_before_the_statement(url: str) -> None:
    conn = pymysql.connect(**connect_args(url))
    try:
        with pytest.raises(ValueError, match="at most 255"):
            Inbox().mark(conn, "c" * 256, new_event_id())  # IGNORE would truncate it
        with pytest.raises(ValueError, match="not a UUID"):
            Inbox().mark(conn, "billing", "42")
        with pytest.raises(ValueError, match="non-empty"):
            Inbox().mark(conn, " ", new_event_id())
    finally:
        conn.close()


_RACER = textwrap.dedent(
    """
    import asyncio, sys, time, uuid
    from outboxkit import Inbox
    from outboxkit.backends.mariadb.sql import connect_args
    ids, driver = sys.argv[2].split(","), sys.argv[3]
    if driver == "aiomysql":  # from the other end: the two meet, each wins some (in the
        ids.reverse()         # same order the one ahead stays ahead and wins them all)
    args, inbox = connect_args(sys.argv[1]), Inbox()
    LEDGER = "INSERT INTO ledger (event_id, amount) VALUES (%s, 1)"

    def ready_then_go():  # imported and connected: say so, then wait for the common start
        print("ready", flush=True)
        sys.stdin.readline()

    def sync():
        import pymysql
        conn, applied = pymysql.connect(**args), 0
        ready_then_go()
        for raw in ids:
            with inbox.handle(conn, "billing", uuid.UUID(raw)) as fresh:
                if fresh:
                    with conn.cursor() as cur:
                        cur.execute(LEDGER, (raw,))
                        cur.execute("DO SLEEP(0.002)")  # widen the race window
                    applied += 1
            conn.commit()
        return applied

    async def asynchronous():
        import aiomysql
        conn = await aiomysql.connect(**{k: v for k, v in args.items() if k != "database"},
                                      db=args["database"])
        applied = 0
        ready_then_go()
        for raw in ids:
            async with inbox.ahandle(conn, "billing", uuid.UUID(raw)) as fresh:
                if fresh:
                    async with conn.cursor() as cur:
                        await cur.execute(LEDGER, (raw,))
                        await cur.execute("DO SLEEP(0.002)")
                    applied += 1
            await conn.commit()
        conn.close()
        return applied

    print(sync() if driver == "pymysql" else asyncio.run(asynchronous()))
    """
)


def test_two_consumer_processes_racing_on_the_same_events_apply_each_once(url: str) -> None:
    ids = [str(new_event_id()) for _ in range(150)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, url, ",".join(ids), driver],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for driver in ("pymysql", "aiomysql")
    ]
    for proc in procs:  # a start barrier: both imported and connected (a fixed delay was
        assert proc.stdout is not None  # too short under load: one process won all 150)
        assert proc.stdout.readline().strip() == b"ready", proc.stderr and proc.stderr.read()
    for proc in procs:  # go: to both, before waiting for either
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
    applied = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        applied.append(int(out))
    rows = _ledger(url)
    assert sorted(r[0] for r in rows) == sorted(ids)  # each once: none twice, none lost
    assert sum(applied) == len(ids)
    assert all(applied), f"both consumers must have won some events: {applied}"


def test_a_duplicate_counts_no_row_where_on_duplicate_key_would_count_one(url: str) -> None:
    """Why the record is an INSERT IGNORE: under CLIENT.FOUND_ROWS (SQLAlchemy's and Django's
    MySQL default) `ON DUPLICATE KEY UPDATE` reports a duplicate as one row, which would read
    as "fresh" and apply the event twice; the inbox's statement reports none."""
    from pymysql.constants import CLIENT

    conn = pymysql.connect(**connect_args(url), client_flag=CLIENT.FOUND_ROWS)
    event_id = str(new_event_id())
    naive = (
        "INSERT INTO processed_events (consumer_name, event_id) VALUES (%s, %s)"
        " ON DUPLICATE KEY UPDATE event_id = event_id"
    )
    try:
        with conn.cursor() as cur:
            assert cur.execute(naive, ("billing", event_id)) == 1
            assert cur.execute(naive, ("billing", event_id)) == 1  # the duplicate looks fresh
        assert Inbox().mark(conn, "billing", event_id) is False
        assert Inbox().mark(conn, "shipping", event_id) is True
        conn.rollback()
    finally:
        conn.close()
