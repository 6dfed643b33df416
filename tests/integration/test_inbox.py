"""The inbox against a real PostgreSQL: each event changes the consumer's table once.

Every test has its own database with the inbox migrated and a `ledger` table standing for
the consumer's business data (no unique constraint: a double apply would show as two rows).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outboxkit import Inbox, NotInTransactionError
from outboxkit.backends.postgres.migrate import migrate_inbox
from outboxkit.events import new_event_id
from outboxkit.ops.cli import main

CREATE_LEDGER = "CREATE TABLE ledger (id serial PRIMARY KEY, event_id uuid NOT NULL, amount int)"
INSERT_LEDGER = "INSERT INTO ledger (event_id, amount) VALUES (%s, %s)"


@pytest.fixture
def consumer_dsn(db_dsn: str) -> Iterator[str]:
    """The consumer's database: inbox migrated (twice: idempotent), plus its ledger table."""
    migrate_inbox(db_dsn)
    migrate_inbox(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(CREATE_LEDGER)
    yield db_dsn


def ledger(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT event_id, amount FROM ledger ORDER BY id").fetchall()


def records(dsn: str, consumer: str | None = None) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM processed_events WHERE %s::text IS NULL OR consumer_name = %s",
            (consumer, consumer),
        ).fetchone()
        assert row is not None
        return int(row[0])


def test_same_event_delivered_three_times_changes_the_table_once(consumer_dsn: str) -> None:
    inbox = Inbox()
    event_id = new_event_id()
    outcomes = []
    with psycopg.connect(consumer_dsn) as conn:
        for _ in range(3):  # a redelivery, then a relay re-publish
            with conn.transaction(), inbox.handle(conn, "billing", event_id) as fresh:
                outcomes.append(fresh)
                if fresh:
                    conn.execute(INSERT_LEDGER, (event_id, 42))
    assert outcomes == [True, False, False]
    assert ledger(consumer_dsn) == [(event_id, 42)]
    assert records(consumer_dsn, "billing") == 1


def test_consumers_are_deduplicated_separately(consumer_dsn: str) -> None:
    inbox = Inbox()
    event_id = new_event_id()
    with psycopg.connect(consumer_dsn) as conn, conn.transaction():
        assert inbox.mark(conn, "billing", event_id) is True
        assert inbox.mark(conn, "shipping", str(event_id)) is True
        assert inbox.mark(conn, "billing", event_id) is False
        assert inbox.seen(conn, "shipping", event_id) is True
        assert inbox.seen(conn, "audit", event_id) is False
    assert records(consumer_dsn) == 2


def test_handler_that_raises_leaves_no_record_and_the_retry_applies(consumer_dsn: str) -> None:
    inbox = Inbox()
    event_id = new_event_id()
    with psycopg.connect(consumer_dsn) as conn:
        with pytest.raises(RuntimeError, match="payment service down"):
            with conn.transaction(), inbox.handle(conn, "billing", event_id) as fresh:
                assert fresh
                conn.execute(INSERT_LEDGER, (event_id, 1))
                raise RuntimeError("payment service down")
        assert records(consumer_dsn) == 0
        assert ledger(consumer_dsn) == []
        with conn.transaction(), inbox.handle(conn, "billing", event_id) as fresh:
            assert fresh, "the redelivered event must be applied after the failed attempt"
            conn.execute(INSERT_LEDGER, (event_id, 2))
    assert ledger(consumer_dsn) == [(event_id, 2)]


_RACER = textwrap.dedent(
    """
    import sys, time, uuid, psycopg
    from outboxkit import Inbox
    dsn, start_at, ids = sys.argv[1], float(sys.argv[2]), sys.argv[3].split(",")
    inbox, applied = Inbox(), 0
    with psycopg.connect(dsn) as conn:
        while time.time() < start_at:
            time.sleep(0.005)
        for raw in ids:
            with conn.transaction(), inbox.handle(conn, "billing", uuid.UUID(raw)) as fresh:
                if fresh:
                    conn.execute("INSERT INTO ledger (event_id, amount) VALUES (%s, 1)", (raw,))
                    conn.execute("SELECT pg_sleep(0.002)")  # widen the race window
                    applied += 1
    print(applied)
    """
)


def test_two_consumer_processes_racing_on_the_same_events_apply_each_once(
    consumer_dsn: str,
) -> None:
    import time

    ids = [str(new_event_id()) for _ in range(150)]
    start_at = time.time() + 1.5  # both processes imported and connected by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, consumer_dsn, str(start_at), ",".join(ids)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    applied = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        applied.append(int(out))
    rows = ledger(consumer_dsn)
    assert len(rows) == len(ids)
    assert sorted(str(r[0]) for r in rows) == sorted(ids)
    assert sum(applied) == len(ids)
    assert records(consumer_dsn, "billing") == len(ids)


# -- every adapter -------------------------------------------------------------------


def test_sqlalchemy_session_and_connection(consumer_dsn: str) -> None:
    inbox = Inbox()
    engine = sa.create_engine(consumer_dsn.replace("postgresql://", "postgresql+psycopg://"))
    event_id = new_event_id()
    try:
        for _ in range(2):
            with Session(engine) as session, session.begin():
                with inbox.handle(session, "billing", event_id) as fresh:
                    if fresh:
                        session.execute(
                            sa.text("INSERT INTO ledger (event_id, amount) VALUES (:e, 1)"),
                            {"e": event_id},
                        )
        with engine.begin() as conn:
            assert inbox.mark(conn, "billing", event_id) is False
            assert inbox.seen(conn, "billing", event_id) is True
        with Session(engine) as session, pytest.raises(NotInTransactionError):
            inbox.mark(session, "billing", new_event_id())
        with pytest.raises(NotInTransactionError, match="Engine"):
            inbox.mark(engine, "billing", new_event_id())
    finally:
        engine.dispose()
    assert ledger(consumer_dsn) == [(event_id, 1)]


def test_psycopg2_through_sqlalchemy(consumer_dsn: str) -> None:
    inbox = Inbox()
    engine = sa.create_engine(consumer_dsn.replace("postgresql://", "postgresql+psycopg2://"))
    event_id = new_event_id()
    try:
        with engine.begin() as conn:
            assert inbox.mark(conn, "billing", event_id) is True
            assert inbox.mark(conn, "billing", event_id) is False
    finally:
        engine.dispose()
    assert records(consumer_dsn) == 1


async def test_psycopg_async_connection(consumer_dsn: str) -> None:
    inbox = Inbox()
    event_id = new_event_id()
    async with await psycopg.AsyncConnection.connect(consumer_dsn) as conn:
        outcomes = []
        for _ in range(3):
            async with conn.transaction(), inbox.ahandle(conn, "billing", event_id) as fresh:
                outcomes.append(fresh)
                if fresh:
                    await conn.execute(INSERT_LEDGER, (event_id, 7))
        assert outcomes == [True, False, False]
        await conn.set_autocommit(True)
        with pytest.raises(NotInTransactionError, match="autocommit"):
            await inbox.amark(conn, "billing", new_event_id())
    assert ledger(consumer_dsn) == [(event_id, 7)]


async def test_asyncpg_connection(consumer_dsn: str) -> None:
    inbox = Inbox()
    event_id = new_event_id()
    conn = await asyncpg.connect(consumer_dsn)
    try:
        for _ in range(2):
            async with conn.transaction(), inbox.ahandle(conn, "billing", event_id) as fresh:
                if fresh:
                    await conn.execute(
                        "INSERT INTO ledger (event_id, amount) VALUES ($1, 3)", event_id
                    )
        with pytest.raises(NotInTransactionError, match="asyncpg"):
            await inbox.amark(conn, "billing", new_event_id())
        async with conn.transaction():
            assert await inbox.aseen(conn, "billing", event_id) is True
    finally:
        await conn.close()
    assert ledger(consumer_dsn) == [(event_id, 3)]


async def test_sqlalchemy_async_session(consumer_dsn: str) -> None:
    inbox = Inbox()
    engine = create_async_engine(consumer_dsn.replace("postgresql://", "postgresql+asyncpg://"))
    event_id = new_event_id()
    try:
        for _ in range(2):
            async with AsyncSession(engine) as session, session.begin():
                async with inbox.ahandle(session, "billing", event_id) as fresh:
                    if fresh:
                        await session.execute(
                            sa.text("INSERT INTO ledger (event_id, amount) VALUES (:e, 5)"),
                            {"e": event_id},
                        )
        async with engine.begin() as conn:
            assert await inbox.aseen(conn, "billing", event_id) is True
        async with AsyncSession(engine) as session:
            with pytest.raises(NotInTransactionError):
                await inbox.amark(session, "billing", new_event_id())
    finally:
        await engine.dispose()
    assert ledger(consumer_dsn) == [(event_id, 5)]


def test_wrong_arguments_are_refused_with_a_reason(consumer_dsn: str) -> None:
    inbox = Inbox()
    with psycopg.connect(consumer_dsn) as conn:
        with pytest.raises(ValueError, match="not a UUID"), conn.transaction():
            inbox.mark(conn, "billing", "not-a-uuid")
        with pytest.raises(ValueError, match="consumer name"), conn.transaction():
            inbox.mark(conn, "", uuid.uuid4())
        with pytest.raises(TypeError, match="async connection"):
            inbox.mark(object.__new__(psycopg.AsyncConnection), "billing", uuid.uuid4())
    with psycopg.connect(consumer_dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransactionError, match="autocommit"):
            inbox.mark(conn, "billing", uuid.uuid4())


def test_missing_inbox_table_fails_inside_the_transaction(db_dsn: str) -> None:
    with psycopg.connect(db_dsn) as conn, pytest.raises(psycopg.errors.UndefinedTable):
        with conn.transaction():
            Inbox("no_such_inbox").mark(conn, "billing", uuid.uuid4())


# -- operations ----------------------------------------------------------------------


def test_migrate_inbox_cli_is_idempotent_and_prints_sql(db_dsn: str) -> None:
    runner = CliRunner()
    for _ in range(2):
        result = runner.invoke(
            main, ["migrate", "--inbox", "--inbox-table", "app_inbox", "--dsn", db_dsn]
        )
        assert result.exit_code == 0, result.output
        assert "app_inbox" in result.output
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        assert Inbox("app_inbox").mark(conn, "billing", uuid.uuid4()) is True
    printed = runner.invoke(main, ["migrate", "--inbox", "--print-sql"])
    assert printed.exit_code == 0
    assert 'CREATE TABLE IF NOT EXISTS "processed_events"' in printed.output
    assert "PRIMARY KEY (consumer_name, event_id)" in printed.output
    bad = runner.invoke(main, ["migrate", "--inbox", "--print-sql", "--inbox-table", "x;drop"])
    assert bad.exit_code == 2
    assert "invalid" in bad.output


def test_purge_inbox_deletes_only_old_records_in_batches(consumer_dsn: str) -> None:
    inbox = Inbox()
    with psycopg.connect(consumer_dsn) as conn, conn.transaction():
        for i in range(7):
            inbox.mark(conn, "billing" if i % 2 else "shipping", new_event_id())
        conn.execute(
            "UPDATE processed_events SET processed_at = now() - interval '10 days'"
            " WHERE event_id IN (SELECT event_id FROM processed_events LIMIT 5)"
        )
        inbox.mark(conn, "billing", new_event_id())  # recent: kept
    runner = CliRunner()
    result = runner.invoke(
        main,
        ["purge", "--inbox", "--older-than", "7d", "--batch-size", "2", "--json"],
        env={"OUTBOXKIT_DSN": consumer_dsn},
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip() == '{"deleted": 5}'
    assert records(consumer_dsn) == 3
    again = runner.invoke(
        main, ["purge", "--inbox", "--older-than", "1h"], env={"OUTBOXKIT_DSN": consumer_dsn}
    )
    assert again.exit_code == 0, again.output
    assert "deleted 0 inbox record(s)" in again.output
    missing = runner.invoke(
        main,
        ["purge", "--inbox", "--inbox-table", "nope", "--older-than", "1d"],
        env={"OUTBOXKIT_DSN": consumer_dsn},
    )
    assert missing.exit_code == 2
    assert "migrate --inbox" in missing.output
