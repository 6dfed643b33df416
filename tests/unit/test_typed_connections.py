"""The transaction boundary is structural as far as a type checker goes: mypy rejects a
pool, an engine or a sessionmaker where a connection inside a transaction is due, and
``with``/``async with`` on the wrong outbox transaction, before anything runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SNIPPET = """
import asyncpg
import psycopg
import psycopg_pool
import sqlalchemy
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from outboxkit import Event, Inbox, Outbox


def sync_api(
    conn: psycopg.Connection,
    session: Session,
    sa_conn: sqlalchemy.Connection,
    pool: psycopg_pool.ConnectionPool,
    engine: sqlalchemy.Engine,
    maker: sessionmaker[Session],
    aconn: psycopg.AsyncConnection,
    event: Event,
) -> None:
    outbox, inbox = Outbox(), Inbox()
    outbox.put(conn, event)
    outbox.put(session, event)
    outbox.put_many(sa_conn, [event])
    inbox.mark(session, "billing", event.event_id)
    outbox.put(pool, event)  # error
    outbox.put(engine, event)  # error
    outbox.put_many(maker, [event])  # error
    outbox.put(aconn, event)  # error
    inbox.mark(engine, "billing", event.event_id)  # error
    with outbox.transaction(conn) as tx:
        tx.put(event)
    outbox.transaction(pool)  # error


async def async_api(
    aconn: psycopg.AsyncConnection,
    apg: asyncpg.Connection,
    apg_pool: asyncpg.Pool,
    asession: AsyncSession,
    aengine: AsyncEngine,
    amaker: async_sessionmaker[AsyncSession],
    conn: psycopg.Connection,
    event: Event,
) -> None:
    outbox, inbox = Outbox(), Inbox()
    await outbox.aput(aconn, event)
    await outbox.aput(apg, event)
    await outbox.aput(asession, event)
    async with apg_pool.acquire() as pooled:
        await outbox.aput(pooled, event)
    await inbox.amark(apg, "billing", event.event_id)
    await outbox.aput(apg_pool, event)  # error
    await outbox.aput(aengine, event)  # error
    await outbox.aput_many(amaker, [event])  # error
    await outbox.aput(conn, event)  # error
    await inbox.amark(aengine, "billing", event.event_id)  # error
    async with outbox.atransaction(aconn) as atx:
        atx.put(event)
    with outbox.atransaction(aconn):  # error
        pass
    async with outbox.transaction(conn):  # error
        pass
"""


def test_mypy_rejects_what_is_not_a_connection_in_a_transaction(tmp_path: Path) -> None:
    source = tmp_path / "snippet.py"
    source.write_text(SNIPPET)
    # A cache that outlives the test: the first run parses psycopg and SQLAlchemy (~20 s),
    # later runs take a few seconds. It lives in the checkout (gitignored), owned by whoever
    # runs the tests: a shared path in /tmp made by another user crashed mypy.
    cache = Path(__file__).resolve().parents[2] / ".mypy_cache" / "typed-connections"
    done = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
            "--no-error-summary", "--cache-dir", str(cache), "--show-error-codes", str(source),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    reported = {
        int(m.group(1))
        for m in re.finditer(r"^.*snippet\.py:(\d+): error:", done.stdout, re.MULTILINE)
    }
    expected = {
        n for n, line in enumerate(SNIPPET.splitlines(), start=1) if line.endswith("# error")
    }
    assert reported == expected, done.stdout + done.stderr
