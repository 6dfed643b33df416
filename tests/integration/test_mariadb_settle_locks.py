"""The settle deadlock (MariaDB error 1213) between two relays, and its cause.

On a near-empty table (a relay keeping up) the optimizer reads ``WHERE id IN (…)`` by
scanning the whole table, and a locking scan waits on every row another relay holds. Two
settles then wait on each other: one holds its batch (fence ``SELECT … FOR UPDATE``) and
scans into the other's; the other holds its own and its ``DELETE`` scans into the first's.
InnoDB's report (``SHOW ENGINE INNODB STATUS``) showed exactly that pair, each waiting on
a row outside its own id list. The store's statements read their ids by primary key.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import Statements, connect_args, with_ids
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import own_database

A, B = "0190a7c4-0000-7000-8000-00000000000a", "0190a7c4-0000-7000-8000-00000000000b"
FIRST, SECOND = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    with own_database(mariadb_server, "sl") as url:
        migrate(url)  # statistics of an empty table
        conn = _connect(url)
        with conn.cursor() as cur:  # ten claimed rows: 1-5 by claim B, 6-10 by claim A
            cur.execute(
                "INSERT INTO outbox (event_id, topic, event_type, payload, headers, claim_token)"
                " SELECT CONCAT('00000000-0000-7000-8000-', LPAD(seq, 12, '0')), 't', 'e', '',"
                f" '{{}}', IF(seq <= 5, '{B}', '{A}') FROM seq_1_to_10"
            )
        conn.close()
        yield url


def _connect(url: str) -> Any:
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    with conn.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")  # as the store
        cur.execute("SET SESSION innodb_lock_wait_timeout = 1")
    return conn


def _naive(statement: str) -> str:
    """``statement`` without the forced primary key (as before the fix)."""
    return statement.replace(" FORCE INDEX (PRIMARY)", "").replace(
        "DELETE `outbox` FROM", "DELETE FROM"
    )


def _settles(url: str, fence: str, delete: str) -> list[int]:
    """Settle A's batch (6-10) while B's settle (1-5) runs beside it, as two relays do:
    A holds its batch, B's fence is under way, then A deletes (and rolls back). The MySQL
    error numbers the two met (empty: none)."""
    a, b = _connect(url), _connect(url)
    errors: list[int] = []

    def settle_b() -> None:
        try:
            with b.cursor() as cur:
                cur.execute("BEGIN")
                cur.execute(with_ids(fence, 5), (*FIRST, B))
                cur.execute("COMMIT")
        except pymysql.err.OperationalError as exc:
            errors.append(exc.args[0])

    try:
        with a.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute(with_ids(fence, 5), (*SECOND, A))
            assert [r[0] for r in cur.fetchall()] == SECOND
            other = threading.Thread(target=settle_b)
            other.start()
            _until_b_holds_or_waits(cur, b.thread_id(), other)
            try:
                cur.execute(with_ids(delete, 5), (*SECOND, A))
                assert cur.rowcount == 5
                cur.execute("ROLLBACK")  # (the next run finds the same rows)
            except pymysql.err.OperationalError as exc:
                errors.append(exc.args[0])
            other.join(10)
    finally:
        a.close()
        b.close()
    return errors


def _until_b_holds_or_waits(cur: Any, thread_id: int, other: threading.Thread) -> None:
    deadline = time.monotonic() + 5
    while other.is_alive() and time.monotonic() < deadline:
        cur.execute(
            "SELECT trx_state FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id = %s",
            (thread_id,),
        )
        if cur.fetchone() == ("LOCK WAIT",):
            return
        time.sleep(0.01)


def _plan(url: str, statement: str, params: Any) -> str:
    conn = _connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("EXPLAIN " + statement, params)
            return str(cur.fetchone()[3])  # type (ALL, index, range, ...)
    finally:
        conn.close()


def test_two_settles_deadlock_when_ids_are_scanned_and_not_when_read_by_key(url: str) -> None:
    s = Statements()
    fence, delete = s.fenced_ids + " FOR UPDATE", s.settle_published_delete
    naive_fence, naive_delete = _naive(fence), _naive(delete)
    # the naive plan on a near-empty table: a scan of every row, not the five ids
    assert _plan(url, with_ids(naive_fence, 5), (*FIRST, B)) in ("ALL", "index")
    assert _plan(url, with_ids(fence, 5), (*FIRST, B)) == "range"
    assert _plan(url, with_ids(delete, 5), (*SECOND, A)) == "range"
    # each waits on the other: InnoDB kills one (1213), or, when its detector misses the
    # cycle (seen in about one run of three), both wait out the lock timeout (1205)
    assert _settles(url, naive_fence, naive_delete) in ([1213], [1205, 1205])
    assert _settles(url, fence, delete) == []
