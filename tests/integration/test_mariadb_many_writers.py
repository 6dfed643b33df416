"""Many writers on MariaDB, on the private mariadbd: what can make an outbox write wait or
deadlock, and what a writer sees when it does.

* The cause removed: a claim at MariaDB's default REPEATABLE READ locks the gap at the end
  of the pending rows, where every new event goes, so writers' INSERTs wait for the claim
  (and time out, 1205); the store's claim runs READ COMMITTED and no writer waits on it.
* 16 writers, 8 through ``transaction()`` and 8 through ``put``: no row lock wait between
  them (the server's own counters); with a relay claiming and deleting beside them, no
  deadlock, every committed event published once.
* What is left (a deadlock in the caller's own locks, crossed with the outbox's): ``put``
  raises ``TransactionConflictError`` (errno 1213, the driver's error as its cause) saying
  the whole transaction is gone and to run it again (``transaction()``'s case is in
  test_mariadb_write_commit.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest
from pymysql.constants import CLIENT

from outboxkit import Event, Outbox, PublishResult, Relay, TransactionConflictError
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import Statements, connect_args
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database
from tests.support.mariadb_ops import commit_events, mariadb_execute

WRITERS = 16
TRANSACTIONS = 40  # per writer


def _schema(url: str) -> None:
    migrate(url)
    mariadb_execute(url, "CREATE TABLE orders (id INT PRIMARY KEY, note TEXT NOT NULL)")


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    with database(mariadb_server, "mw", _schema) as url:
        yield url


def _counters(url: str) -> dict[str, int]:
    rows = mariadb_execute(
        url,
        "SHOW GLOBAL STATUS WHERE Variable_name IN ('Innodb_deadlocks', 'Innodb_row_lock_waits')",
    )
    return {name: int(value) for name, value in rows}


def _event(topic: str = "orders") -> Event:
    return Event(topic=topic, event_type="order.placed", payload={"n": 1})


def _writer(url: str, **options: Any) -> Any:
    return pymysql.connect(**connect_args(url), client_flag=CLIENT.MULTI_STATEMENTS, **options)


def _hold_claim(url: str, isolation: str) -> Any:
    """A session that ran the store's claim statement at ``isolation`` and holds its locks."""
    conn = pymysql.connect(**connect_args(url))
    with conn.cursor() as cur:
        cur.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {isolation}")
        conn.begin()
        cur.execute(Statements("outbox").claim_lock, (100,))
        assert len(cur.fetchall()) == 3
    return conn


def _commit_one_event(url: str, seconds: float) -> BaseException | None:
    """A writer's transaction() with one order and its event, waiting on locks at most
    ``seconds``; what it raised, if anything."""
    conn = _writer(url)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SET SESSION innodb_lock_wait_timeout = {seconds}")
        with Outbox().transaction(conn) as tx:
            with conn.cursor() as cur:
                cur.execute("INSERT INTO orders (id, note) VALUES (1, 'waited')")
            tx.put(_event("late"))
    except Exception as exc:
        return exc
    finally:
        conn.close()
    return None


def test_a_claim_at_repeatable_read_makes_every_writer_wait_and_time_out(url: str) -> None:
    """The naive claimer: MariaDB's default isolation takes next-key locks on the range it
    read, up to the end of the pending rows, which is where a new event's row goes."""
    commit_events(url, [_event() for _ in range(3)])
    before = _counters(url)
    claimer = _hold_claim(url, "REPEATABLE READ")
    try:
        failed = _commit_one_event(url, 1)
    finally:
        claimer.rollback()
        claimer.close()
    assert isinstance(failed, TransactionConflictError)
    assert failed.errno == 1205
    assert "lock wait timeout" in str(failed) and "rolled the whole transaction back" in str(failed)
    assert _counters(url)["Innodb_row_lock_waits"] > before["Innodb_row_lock_waits"]
    assert mariadb_execute(url, "SELECT COUNT(*) FROM orders") == [(0,)]  # all of it undone


def test_the_stores_read_committed_claim_never_makes_a_writer_wait(url: str) -> None:
    commit_events(url, [_event() for _ in range(3)])
    before = _counters(url)
    claimer = _hold_claim(url, "READ COMMITTED")  # what MariaDBQueueStore's sessions set
    try:
        started = time.monotonic()
        assert _commit_one_event(url, 1) is None
        assert time.monotonic() - started < 0.5
    finally:
        claimer.rollback()
        claimer.close()
    assert _counters(url)["Innodb_row_lock_waits"] == before["Innodb_row_lock_waits"]
    assert mariadb_execute(url, "SELECT topic FROM outbox ORDER BY id")[-1] == ("late",)


class _Collect:
    """A publisher whose broker confirms at once; what it was given, by event id."""

    name = "collect"

    def __init__(self) -> None:
        self.published: list[str] = []

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def publish_batch(self, messages: Any) -> list[PublishResult]:
        self.published.extend(str(m.event_id) for m in messages)
        return [PublishResult.success()] * len(messages)


def _write_orders(url: str, k: int, committed: list[str], errors: list[BaseException]) -> None:
    """Writer ``k``: its own orders and one event each, by transaction() (even k) or put."""
    outbox = Outbox()
    conn = _writer(url)
    try:
        for n in range(TRANSACTIONS):
            event = _event()
            order = (k * TRANSACTIONS + n, f"writer {k}")
            if k % 2 == 0:
                with outbox.transaction(conn) as tx, conn.cursor() as cur:
                    cur.execute("INSERT INTO orders (id, note) VALUES (%s, %s)", order)
                    tx.put(event)
            else:
                with conn.cursor() as cur:
                    cur.execute("INSERT INTO orders (id, note) VALUES (%s, %s)", order)
                outbox.put(conn, event)
                conn.commit()
            committed.append(str(event.event_id))
    except BaseException as exc:
        errors.append(exc)
    finally:
        conn.close()


def test_sixteen_writers_never_wait_on_each_others_outbox_rows(url: str) -> None:
    """AUTO_INCREMENT ids (innodb_autoinc_lock_mode 1: a multi-row INSERT of known length
    takes no table lock) and insert-intention locks at the end of the same indexes: 16
    writers, half of them through transaction(), never wait for one another."""
    before = _counters(url)
    committed: list[str] = []
    errors: list[BaseException] = []
    writers = [
        threading.Thread(target=_write_orders, args=(url, k, committed, errors))
        for k in range(WRITERS)
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    after = _counters(url)
    assert (errors, len(committed)) == ([], WRITERS * TRANSACTIONS)
    assert {k: after[k] - before[k] for k in after} == {
        "Innodb_deadlocks": 0,
        "Innodb_row_lock_waits": 0,
    }


async def test_sixteen_writers_beside_a_relay_never_deadlock_and_each_event_is_published_once(
    url: str,
) -> None:
    """The relay claims (READ COMMITTED, SKIP LOCKED) and deletes beside the writers. Its
    settle may wait a moment for its own next claim's scan (a few row lock waits a run,
    the relay's alone: none with the writers alone, above); no writer fails, nothing
    deadlocks."""
    publisher = _Collect()
    relay = Relay(url, publisher, poll_interval=0.01, batch_size=50)
    before = _counters(url)
    running = asyncio.create_task(relay.run())
    committed: list[str] = []
    errors: list[BaseException] = []
    writers = [
        threading.Thread(target=_write_orders, args=(url, k, committed, errors))
        for k in range(WRITERS)
    ]
    try:
        for w in writers:
            w.start()
        while any(w.is_alive() for w in writers):
            await asyncio.sleep(0.05)
        async with asyncio.timeout(30):
            while len(publisher.published) < len(committed) and not running.done():
                await asyncio.sleep(0.02)
    finally:
        relay.stop()
        await running
    after = _counters(url)
    assert errors == []
    assert len(committed) == WRITERS * TRANSACTIONS
    assert sorted(publisher.published) == sorted(committed)  # each once
    assert after["Innodb_deadlocks"] - before["Innodb_deadlocks"] == 0


def test_a_deadlock_at_puts_insert_raises_transaction_conflict_naming_the_retry(
    url: str,
) -> None:
    """Another transaction holds a gap lock on the outbox (a REPEATABLE READ locking read of
    the caller's own) and waits for this one's order row; this one's put waits for the gap:
    InnoDB rolls this one back, whole."""
    mariadb_execute(url, "INSERT INTO orders (id, note) VALUES (1, 'shared')")
    other = pymysql.connect(**connect_args(url))
    conn = _writer(url)
    try:
        with other.cursor() as cur:  # the heavier transaction: InnoDB keeps it
            cur.executemany(
                "INSERT INTO orders (id, note) VALUES (%s, 'heavy')", [(i,) for i in range(2, 52)]
            )
            cur.execute("SELECT id FROM outbox FOR UPDATE")
        with conn.cursor() as cur:
            cur.execute("UPDATE orders SET note = 'mine' WHERE id = 1")
        waiting = threading.Thread(target=_update_order_one, args=(other,))
        waiting.start()
        _wait_for_a_lock_wait(url)
        with pytest.raises(
            TransactionConflictError, match=r"deadlock.*Run the whole transaction again"
        ) as raised:
            Outbox().put(conn, _event("deadlocked"))
        waiting.join(timeout=10)
        other.commit()
    finally:
        other.close()
        conn.close()
    assert raised.value.errno == 1213
    assert isinstance(raised.value.__cause__, pymysql.err.OperationalError)
    assert mariadb_execute(url, "SELECT note FROM orders WHERE id = 1") == [("theirs",)]
    assert mariadb_execute(url, "SELECT COUNT(*) FROM outbox") == [(0,)]


def _update_order_one(conn: Any) -> None:
    with conn.cursor() as cur:
        cur.execute("UPDATE orders SET note = 'theirs' WHERE id = 1")


def _wait_for_a_lock_wait(url: str) -> None:
    query = "SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
    deadline = time.monotonic() + 5.0
    while mariadb_execute(url, query) != [(1,)]:
        assert time.monotonic() < deadline, "the other transaction never waited"
        time.sleep(0.01)
