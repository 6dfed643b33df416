"""`Outbox(storage="mariadb").transaction()` on the private MariaDB: the events travel with the
COMMIT, one round trip (counted on the wire by a proxy that reads the protocol), through
PyMySQL, mysqlclient, aiomysql and asyncmy; atomic with the business rows when the block
raises, when the INSERT fails or deadlocks, when the COMMIT fails, and when the connection
or the writer dies with the COMMIT in flight. The naive multi-statement (``cur.execute("INSERT …;
COMMIT")``) is shown hiding a failed COMMIT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest
from pymysql.constants import CLIENT

from outboxkit import Event, Outbox
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.drivers.base import dbapi_params
from outboxkit.errors import NotInTransactionError, TableNotFoundError, TransactionConflictError
from outboxkit.write import mariadb_commit
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database, driver_module
from tests.support.mysql_wire import CountingProxy

ROOT = Path(__file__).resolve().parents[2]
POISON = "poison"  # a topic the outbox table's trigger refuses: the INSERT fails
SYNC = ("pymysql", "mysqlclient")
ASYNC = ("aiomysql", "asyncmy")


def _schema(url: str) -> None:
    migrate(url)
    _run(url, "CREATE TABLE orders (id INT AUTO_INCREMENT PRIMARY KEY, note TEXT NOT NULL)")
    _run(
        url,
        "CREATE TRIGGER outbox_poison BEFORE INSERT ON outbox FOR EACH ROW"
        f" IF NEW.topic = '{POISON}' THEN SIGNAL SQLSTATE '45000'"
        " SET MESSAGE_TEXT = 'poisoned event'; END IF",
    )


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    with database(mariadb_server, "wc", _schema) as url:
        yield url


@pytest.fixture
def proxy(url: str) -> Iterator[CountingProxy]:
    with CountingProxy(connect_args(url)["port"]) as proxy:
        yield proxy


def _run(url: str, statement: str) -> list[tuple[Any, ...]]:
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(statement)
            return list(cur.fetchall())
    finally:
        conn.close()


def _state(url: str) -> tuple[list[str], list[str]]:
    """(the committed orders' notes, the committed events' topics), in id order."""
    notes = [r[0] for r in _run(url, "SELECT note FROM orders ORDER BY id")]
    return notes, [r[0] for r in _run(url, "SELECT topic FROM outbox ORDER BY id")]


def _event(topic: str) -> Event:
    return Event(topic=topic, event_type="order.placed", payload=b"\x00'\\\"%s\xff")


def _args(url: str, port: int | None = None) -> dict[str, Any]:
    return {**connect_args(url), **({"port": port} if port else {})}


def _connect_sync(driver: str, args: dict[str, Any], **options: Any) -> Any:
    if driver == "pymysql":
        return pymysql.connect(**args, client_flag=CLIENT.MULTI_STATEMENTS, **options)
    return driver_module("MySQLdb").connect(**args, **options)


async def _connect_async(driver: str, args: dict[str, Any]) -> Any:
    module = driver_module(driver)
    if driver == "aiomysql":
        args = {**{k: v for k, v in args.items() if k != "database"}, "db": args["database"]}
    return await module.connect(**args)


def _order(conn: Any, note: str) -> None:
    with conn.cursor() as cur:
        cur.execute("INSERT INTO orders (note) VALUES (%s)", (note,))


async def _aorder(conn: Any, note: str) -> None:
    async with conn.cursor() as cur:
        await cur.execute("INSERT INTO orders (note) VALUES (%s)", (note,))


# -- one round trip, every driver ---------------------------------------------------------------


@pytest.mark.parametrize("driver", SYNC)
def test_the_events_and_the_commit_are_one_round_trip_and_commit_with_the_business_rows(
    url: str, proxy: CountingProxy, driver: str
) -> None:
    outbox = Outbox(storage="mariadb")
    conn = _connect_sync(driver, _args(url, proxy.port))
    try:
        with outbox.transaction(conn) as tx:
            _order(conn, "kept")
            tx.put(_event("one"))
            tx.put_many([_event("two"), _event("three")])
            assert _state(url) == ([], [])  # queued: nothing is sent before the end
            before = proxy.commands
        assert proxy.commands - before == 1
        assert proxy.queries[-1].startswith(b"INSERT INTO `outbox`")
        assert proxy.queries[-1].endswith(b";\nCOMMIT")
        with pytest.raises(RuntimeError, match="business failure"):
            with outbox.transaction(conn) as tx:
                _order(conn, "rolled.back")
                tx.put(_event("never"))
                raise RuntimeError("business failure")
        with outbox.transaction(conn):  # no event: a plain COMMIT
            _order(conn, "no.event")
    finally:
        conn.close()
    assert _state(url) == (["kept", "no.event"], ["one", "two", "three"])
    payload = _run(url, "SELECT payload FROM outbox WHERE topic = 'one'")
    assert payload == [(_event("x").payload,)]


@pytest.mark.parametrize("driver", ASYNC)
async def test_async_drivers_send_the_events_with_the_commit_in_one_round_trip(
    url: str, proxy: CountingProxy, driver: str
) -> None:
    outbox = Outbox(storage="mariadb")
    conn = await _connect_async(driver, _args(url, proxy.port))
    try:
        async with outbox.atransaction(conn) as tx:
            await _aorder(conn, "kept")
            tx.put(_event("one"))
            tx.put_many([_event("two")])
            before = proxy.commands
        assert proxy.commands - before == 1
        assert proxy.queries[-1].endswith(b";\nCOMMIT")
        with pytest.raises(RuntimeError, match="business failure"):
            async with outbox.atransaction(conn) as tx:
                await _aorder(conn, "rolled.back")
                tx.put(_event("never"))
                raise RuntimeError("business failure")
    finally:
        conn.close()
    assert _state(url) == (["kept"], ["one", "two"])


def test_pymysql_without_multi_statements_sends_insert_then_commit_and_says_so_once(
    url: str, proxy: CountingProxy, caplog: pytest.LogCaptureFixture
) -> None:
    mariadb_commit._WARNED.clear()
    outbox = Outbox(storage="mariadb")
    conn = pymysql.connect(**_args(url, proxy.port), autocommit=True)  # BEGIN sent for it
    try:
        with caplog.at_level(logging.WARNING, logger="outboxkit.write"):
            for note in ("a", "b"):
                with outbox.transaction(conn) as tx:
                    _order(conn, note)
                    tx.put(_event(note))
                    before = proxy.commands
                assert proxy.commands - before == 2
                assert proxy.queries[-1] == b"COMMIT"
    finally:
        conn.close()
    warned = [r.getMessage() for r in caplog.records if "MULTI_STATEMENTS" in r.getMessage()]
    assert len(warned) == 1 and "client_flag=CLIENT.MULTI_STATEMENTS" in warned[0]
    assert _state(url) == (["a", "b"], ["a", "b"])


def test_the_wrong_connection_is_refused_in_one_line(url: str) -> None:
    outbox = Outbox(storage="mariadb")
    with pytest.raises(TypeError, match="PyMySQL or mysqlclient connection, got builtins.object"):
        outbox.transaction(object())
    with pytest.raises(TypeError, match="aiomysql or asyncmy connection, got pymysql"):
        outbox.atransaction(_connect_sync("pymysql", _args(url)))
    conn = pymysql.connect(**_args(url))
    conn.close()
    with pytest.raises(NotInTransactionError, match="closed"):
        with outbox.transaction(conn):
            pass
    tx = outbox.transaction(_connect_sync("pymysql", _args(url)))
    with pytest.raises(NotInTransactionError, match="inside its `with` block"):
        tx.put(_event("outside"))


# -- failures: the COMMIT never follows a failed INSERT, and a failed COMMIT raises -------------


@pytest.mark.parametrize("driver", SYNC)
def test_a_failed_insert_never_reaches_the_commit_and_the_business_rows_roll_back(
    url: str, proxy: CountingProxy, driver: str
) -> None:
    outbox = Outbox(storage="mariadb")
    conn = _connect_sync(driver, _args(url, proxy.port))
    try:
        with pytest.raises(Exception, match="poisoned event"):
            with outbox.transaction(conn) as tx:
                _order(conn, "with.poison")
                tx.put_many([_event("fine"), _event(POISON)])
        assert _state(url) == ([], [])
        with outbox.transaction(conn) as tx:  # the connection goes on, in sync
            _order(conn, "after")
            tx.put(_event("after"))
    finally:
        conn.close()
    assert _state(url) == (["after"], ["after"])
    assert b"ROLLBACK" in proxy.queries  # outboxkit rolled the business rows back


@pytest.mark.parametrize("driver", ASYNC)
async def test_async_a_failed_insert_never_reaches_the_commit(url: str, driver: str) -> None:
    outbox = Outbox(storage="mariadb")
    conn = await _connect_async(driver, _args(url))
    try:
        with pytest.raises(Exception, match="poisoned event"):
            async with outbox.atransaction(conn) as tx:
                await _aorder(conn, "with.poison")
                tx.put(_event(POISON))
        async with outbox.atransaction(conn) as tx:
            await _aorder(conn, "after")
            tx.put(_event("after"))
    finally:
        conn.close()
    assert _state(url) == (["after"], ["after"])


def test_a_deadlock_at_the_insert_raises_and_rolls_the_whole_transaction_back(url: str) -> None:
    """The events' INSERT waits for another transaction's gap lock on the outbox while that
    one waits for this block's business row: InnoDB breaks the cycle by rolling back the
    lighter transaction, this one. The COMMIT never runs; the caller sees outboxkit's
    TransactionConflictError (errno 1213, the driver's error as its cause) saying to run the
    whole transaction again."""
    _run(url, "INSERT INTO orders (id, note) VALUES (1, 'shared')")
    outbox = Outbox(storage="mariadb")
    other = pymysql.connect(**_args(url))  # REPEATABLE READ: its locking read locks gaps
    conn = _connect_sync("pymysql", _args(url))
    try:
        with other.cursor() as cur:  # the heavier transaction: InnoDB keeps it
            cur.executemany("INSERT INTO orders (note) VALUES (%s)", [("heavy",)] * 50)
            cur.execute("SELECT id FROM outbox FOR UPDATE")  # the gap an INSERT needs
        waiting = threading.Thread(target=_update_shared, args=(other,))
        with pytest.raises(TransactionConflictError, match="deadlock.*again") as raised:
            with outbox.transaction(conn) as tx:
                with conn.cursor() as cur:
                    cur.execute("SET SESSION innodb_lock_wait_timeout = 5")  # (a bound)
                    cur.execute("UPDATE orders SET note = 'mine' WHERE id = 1")
                tx.put(_event("deadlocked"))
                waiting.start()  # the other transaction now waits for this row lock
                assert _wait_for_lock_wait(url)
        waiting.join(timeout=10)
        assert raised.value.errno == 1213
        assert isinstance(raised.value.__cause__, pymysql.err.OperationalError)
        other.commit()
        with outbox.transaction(conn) as tx:  # the connection goes on
            tx.put(_event("after"))
    finally:
        other.close()
        conn.close()
    notes, topics = _state(url)
    assert ("mine" not in notes, notes.count("heavy"), topics) == (True, 50, ["after"])


def _update_shared(conn: Any) -> None:
    with conn.cursor() as cur:
        cur.execute("UPDATE orders SET note = 'theirs' WHERE id = 1")


def _wait_for_lock_wait(url: str) -> bool:
    import time

    deadline = time.monotonic() + 5.0
    query = "SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
    while _run(url, query) != [(1,)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_missing_outbox_table_says_to_migrate_and_nothing_commits(url: str) -> None:
    outbox = Outbox("no_such_outbox", storage="mariadb")
    conn = _connect_sync("pymysql", _args(url))
    try:
        with pytest.raises(TableNotFoundError, match="no_such_outbox.*outboxkit migrate"):
            with outbox.transaction(conn) as tx:
                _order(conn, "orphan")
                tx.put(_event("lost"))
    finally:
        conn.close()
    assert _state(url) == ([], [])


def test_the_naive_multi_statement_hides_a_failed_commit_and_transaction_raises_it(
    url: str,
) -> None:
    """A COMMIT MariaDB refuses (here: inside an XA transaction, error 1399). The naive
    ``cur.execute("INSERT …; COMMIT")`` reads only the INSERT's result: it returns as if
    committed, and the rows are gone when the connection ends. ``transaction()`` reads every
    result and raises."""
    outbox = Outbox(storage="mariadb")
    insert, params = outbox._writer_of(None).storage.one(_event("naive"))  # fixed: MariaDB's
    conn = _connect_sync("pymysql", _args(url))
    try:
        cur = conn.cursor()
        cur.execute("XA START 'naive'")
        _order(conn, "naive")
        cur.execute(insert.text + "; COMMIT", dbapi_params(params))
        # returned without an error: the caller believes both rows committed
    finally:
        conn.close()
    assert _state(url) == ([], [])  # they were not

    conn = _connect_sync("pymysql", _args(url))
    try:
        with pytest.raises(pymysql.err.OperationalError, match="XAER_RMFAIL"):
            with outbox.transaction(conn) as tx:
                with conn.cursor() as cur:
                    cur.execute("XA START 'outboxkit'")
                _order(conn, "xa")
                tx.put(_event("xa"))
    finally:
        conn.close()
    assert _state(url) == ([], [])


# -- the connection or the writer dies with the COMMIT in flight: both or neither ---------------


@pytest.mark.parametrize("forward", [True, False], ids=["server-got-it", "server-never-got-it"])
def test_a_connection_cut_with_the_commit_in_flight_raises_and_commits_both_or_neither(
    url: str, proxy: CountingProxy, forward: bool
) -> None:
    outbox = Outbox(storage="mariadb")
    conn = _connect_sync("pymysql", _args(url, proxy.port))
    try:
        with pytest.raises(pymysql.err.OperationalError, match="Lost connection"):
            with outbox.transaction(conn) as tx:
                _order(conn, "in.flight")
                tx.put(_event("in.flight"))
                proxy.cut_at_next(forward=forward)
    finally:
        conn.close()
    if forward:  # the server ran INSERT and COMMIT; only the answer was lost
        assert _poll(url, (["in.flight"], ["in.flight"]))
    else:
        proxy.close()  # the server sees its client gone: the transaction rolls back
        assert _poll(url, ([], []))
        assert _run(url, CLIENT_TRANSACTIONS) == [(0,)]


def _poll(url: str, expected: tuple[list[str], list[str]], timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while _state(url) != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


WRITER = """
import sys, pymysql
from pymysql.constants import CLIENT
from outboxkit import Event, Outbox
conn = pymysql.connect(host="127.0.0.1", port=int(sys.argv[1]), user="root",
                       database=sys.argv[2], client_flag=CLIENT.MULTI_STATEMENTS)
with Outbox(storage="mariadb").transaction(conn) as tx:
    conn.cursor().execute("INSERT INTO orders (note) VALUES ('killed')")
    tx.put(Event(topic="killed", event_type="x", payload={}))
    print("inside", flush=True)
    sys.stdin.readline()  # SIGKILLed here, before the block ends
"""


def test_a_writer_killed_inside_the_block_commits_neither(url: str) -> None:
    args = connect_args(url)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(args["port"]), args["database"]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == b"inside"
        # the business row is written (uncommitted) and the event queued
        assert _run(url, CLIENT_TRANSACTIONS) == [(1,)]
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert _poll(url, ([], []))
    assert _poll_no_transaction(url)


# Transactions of client connections only: InnoDB's own background work (persistent
# statistics, seen here after the tables' writes) shows in innodb_trx with a thread id
# that no connection has.
CLIENT_TRANSACTIONS = (
    "SELECT COUNT(*) FROM information_schema.innodb_trx AS t"
    " JOIN information_schema.processlist AS p ON p.id = t.trx_mysql_thread_id"
)


def _poll_no_transaction(url: str) -> bool:
    import time

    deadline = time.monotonic() + 5.0
    while _run(url, CLIENT_TRANSACTIONS) != [(0,)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_transaction_in_ordered_mode_locks_the_keys_in_the_same_round_trip(
    mariadb_server: MariaDB,
) -> None:
    with database(mariadb_server, "wco", lambda u: migrate(u, kind="ordered")) as url:
        outbox = Outbox(storage="mariadb", ordered=True)
        with CountingProxy(connect_args(url)["port"]) as proxy:
            conn = _connect_sync("pymysql", _args(url, proxy.port))
            try:
                with outbox.transaction(conn) as tx:
                    tx.put_many([_event("k1"), _event("free")])
                    tx.put(Event(topic="keyed", event_type="x", payload={}, key="a"))
                    before = proxy.commands
                assert proxy.commands - before == 1
                assert b"key_locks" in proxy.queries[-1]
            finally:
                conn.close()
        rows = _run(url, "SELECT topic, `key` FROM outbox ORDER BY id")
        assert rows == [("k1", None), ("free", None), ("keyed", "a")]


async def test_many_events_split_into_inserts_of_a_batch_each_still_one_round_trip(
    url: str, proxy: CountingProxy
) -> None:
    outbox = Outbox(storage="mariadb")
    conn = await _connect_async("asyncmy", _args(url, proxy.port))
    try:
        for attempt in range(2):  # the first asks max_allowed_packet, once per connection
            async with outbox.atransaction(conn) as tx:
                for _ in range(2):
                    tx.put_many(
                        Event(topic="bulk", event_type="x", payload={}) for _ in range(5000)
                    )
                tx.put(Event(topic="bulk", event_type="x", payload={}))  # 10 001: two INSERTs
                before = proxy.commands
            assert proxy.commands - before == 2 - attempt
            assert proxy.queries[-1].count(b"INSERT INTO") == 2
    finally:
        conn.close()
    await asyncio.sleep(0)
    assert _run(url, "SELECT COUNT(*) FROM outbox") == [(20002,)]
