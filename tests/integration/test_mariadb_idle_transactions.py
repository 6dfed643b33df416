"""A store session frozen inside its transaction does not keep rows locked for hours.

MariaDB's claim is a few statements in one transaction. A worker frozen between two of them
(SIGSTOP, a paused VM) holds the rows it locked, and every other worker's ``SKIP LOCKED``
passes them by for as long as the server keeps the connection (``wait_timeout``: 8 hours by
default). The store's sessions set ``idle_transaction_timeout``: the server ends such a
transaction, its locks with it. A process is frozen for real here (SIGSTOP), holding a row
lock taken through the store's own session; the naive session (the same connection without
the setting) keeps the row from the other worker past the same wait.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pymysql
import pytest

from outboxkit.backends.mariadb.sql import connect_args
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database

TIMEOUT = 1  # the guard's seconds in this test (the store's default is 30)

# A child that locks row 1 through the store's session (or the naive one) and then freezes
# itself with SIGSTOP, its transaction open.
CHILD = """
import asyncio, os, signal, sys
from outboxkit.backends.mariadb import session

session.IDLE_TRANSACTION_TIMEOUT = {timeout}
naive = {naive}
if naive:
    async def _nothing(cur):
        return None
    session._limit_idle_transactions = _nothing

async def main():
    store = session.MariaDBSession(sys.argv[1], roles=("claim",))
    async def lock(cur):
        await cur.execute("BEGIN")
        await cur.execute("SELECT id FROM jobs WHERE id = 1 FOR UPDATE")
        print("locked", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen here, the transaction open
    await store._run("claim", lock)

asyncio.run(main())
"""


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    with database(mariadb_server, "idle") as url:
        conn = pymysql.connect(**connect_args(url), autocommit=True)
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE jobs (id INT PRIMARY KEY) ENGINE = InnoDB")
            cur.execute("INSERT INTO jobs VALUES (1), (2)")
        conn.close()
        yield url


def _frozen_holder(url: str, *, naive: bool) -> subprocess.Popen[str]:
    code = CHILD.format(timeout=TIMEOUT, naive=naive)
    child = subprocess.Popen(
        [sys.executable, "-c", code, url], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "locked"
    return child


def _free_rows(url: str) -> list[int]:
    """What another worker's claim sees: the rows nobody holds a lock on."""
    conn = pymysql.connect(**connect_args(url))
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT id FROM jobs ORDER BY id FOR UPDATE SKIP LOCKED")
            rows = [r[0] for r in cur.fetchall()]
        conn.rollback()
        return rows
    finally:
        conn.close()


def _end(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(10)


@pytest.mark.parametrize("naive", [True, False], ids=["naive", "outboxkit"])
def test_a_frozen_sessions_locks_are_released_after_the_idle_timeout(url: str, naive: bool) -> None:
    child = _frozen_holder(url, naive=naive)
    try:
        assert _free_rows(url) == [2]  # frozen, holding row 1
        deadline = time.monotonic() + TIMEOUT + 4
        while time.monotonic() < deadline and _free_rows(url) != [1, 2]:
            time.sleep(0.25)
        if naive:  # past the same wait the row is still held: for hours, by default
            assert _free_rows(url) == [2]
        else:  # the server ended the frozen transaction, its lock with it
            assert _free_rows(url) == [1, 2]
    finally:
        _end(child)
