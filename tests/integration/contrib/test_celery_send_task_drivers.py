"""``send_task`` writes through every driver the outbox write takes, and only in a transaction.

The relay reads the rows the same way whoever wrote them, so each driver's row is checked
for what the relay turns into the Celery message (name, queue, task id, body, ETA); one
end-to-end run from MariaDB (pymysql) to a real worker shows the other database too.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import psycopg2
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outboxkit import NotInTransactionError
from outboxkit.contrib.celery import asend_task, send_task
from outboxkit.wire import celery as wire
from tests.support.celery_worker import ROOT, celery_env, celery_worker, wait_for_runs
from tests.support.local_brokers import OwnRedis
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database
from tests.support.relaying import rows
from tests.support.servers import unique_name


def _check_row(dsn: str, task_id: str, n: int) -> None:
    [row] = rows(dsn, f"headers->>'{wire.TASK_ID}' = '{task_id}'")
    assert (row["topic"], row["event_type"]) == ("reports", "proj.tasks.render")
    assert json.loads(bytes(row["payload"]))[:2] == [[n], {"fmt": "pdf"}]
    assert row["headers"][wire.ETA] >= dt.datetime.now(dt.UTC).isoformat()


def _sync(conn: Any, n: int) -> str:
    return send_task(conn, "proj.tasks.render", (n,), {"fmt": "pdf"}, queue="reports", countdown=60)


async def _async(conn: Any, n: int) -> str:
    return await asend_task(
        conn, "proj.tasks.render", (n,), {"fmt": "pdf"}, queue="reports", countdown=60
    )


def test_psycopg_psycopg2_and_sqlalchemy_write_the_task_with_the_transaction(db_dsn: str) -> None:
    ids = []
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        ids.append(_sync(conn, 1))
    pg2 = psycopg2.connect(db_dsn)
    try:
        with pg2:  # commits at the end of the block
            ids.append(_sync(pg2, 2))
    finally:
        pg2.close()
    engine = sa.create_engine(db_dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    with Session(engine) as session, session.begin():
        ids.append(_sync(session, 3))
    engine.dispose()
    for n, task_id in enumerate(ids, start=1):
        _check_row(db_dsn, task_id, n)


def test_async_drivers_write_the_task_with_asend_task(db_dsn: str) -> None:
    async def main() -> list[str]:
        ids = []
        async with await psycopg.AsyncConnection.connect(db_dsn) as conn, conn.transaction():
            ids.append(await _async(conn, 1))
        apg = await asyncpg.connect(db_dsn)
        try:
            async with apg.transaction():
                ids.append(await _async(apg, 2))
        finally:
            await apg.close()
        return ids

    for n, task_id in enumerate(asyncio.run(main()), start=1):
        _check_row(db_dsn, task_id, n)


def test_a_rolled_back_or_autocommit_send_task_writes_nothing(db_dsn: str) -> None:
    with psycopg.connect(db_dsn) as conn:
        with conn.transaction():
            _sync(conn, 1)
            raise psycopg.Rollback()
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransactionError):
            _sync(conn, 2)  # the dual write again: refused
    assert rows(db_dsn) == []


@pytest.fixture
def mariadb_url(mariadb_server: MariaDB) -> Iterator[str]:
    from outboxkit.backends.mariadb.migrate import migrate

    with database(mariadb_server, "celery", migrate) as url:
        yield url


def test_a_task_written_on_mariadb_runs_on_a_celery_worker(
    mariadb_url: str, tmp_path: Path
) -> None:
    import pymysql

    from outboxkit.backends.mariadb.sql import connect_args

    redis = OwnRedis(tmp_path / "redis")
    redis.start()
    queue = unique_name("okit_celery")
    record = tmp_path / "runs.jsonl"
    try:
        conn = pymysql.connect(**connect_args(mariadb_url))
        try:
            conn.begin()
            # the default outbox: it follows the connection to MariaDB's table
            task_id = send_task(conn, "outboxkit_test.record", (11,), queue=queue)
            conn.commit()
        finally:
            conn.close()
        with celery_worker(redis.url, queue, record):
            relay = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "outboxkit",
                    "relay",
                    "--dsn",
                    mariadb_url,
                    "--broker",
                    f"celery+{redis.url}",
                    "--poll-interval",
                    "0.2",
                ],
                env=celery_env(redis.url, queue, tmp_path / "unused.jsonl"),
                stdout=(tmp_path / "relay.log").open("ab"),
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
            try:
                [run] = wait_for_runs(record, bool, timeout=30, what="the MariaDB task")
            finally:
                relay.send_signal(signal.SIGTERM)
                relay.wait(20)
        assert (run["id"], run["n"]) == (task_id, 11)
    finally:
        redis.kill()
