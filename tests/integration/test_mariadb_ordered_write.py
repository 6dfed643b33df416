"""Outbox(storage="mariadb", ordered=True): for each key, the ids follow the commit order.

Seed 000's race on MariaDB: two transactions writing one key take AUTO_INCREMENT ids n and
n + 1, and the one holding n + 1 commits first; a relay publishing in id order has then
sent n + 1 when n appears. The naive write shows it; the ordered write locks the key's
row of ``<table>_key_locks`` (FOR UPDATE, held to COMMIT) before its rows take their ids,
so the second writer takes n + 1 only after n committed. A third, unordered writer
committing while the second waits proves the wait came before the id was taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pymysql
import pytest

from outboxkit import Event, Outbox
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import SchemaError
from tests.integration.test_ordered_write import Background
from tests.support.mariadb import MariaDB
from tests.support.servers import unique_name

KEY = "order-42"


@pytest.fixture(scope="module")
def database(mariadb_server: MariaDB) -> Iterator[str]:
    """One ordered outbox for the module (its 65 536 lock rows take seconds to create)."""
    name = unique_name("ow")
    admin = pymysql.connect(**mariadb_server.connect_args(), autocommit=True)
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        migrate(mariadb_server.url_for(name), kind="ordered", partitions=8)
        yield mariadb_server.url_for(name)
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")
    finally:
        admin.close()


@pytest.fixture
def url(database: str) -> str:
    _query(database, "DELETE FROM outbox")
    return database


def _connect(url: str, **options: Any) -> Any:
    return pymysql.connect(**connect_args(url), **options)


def _event(key: str | None = KEY, n: int = 0) -> Event:
    return Event(topic="orders", event_type="order.changed", payload={"n": n}, key=key)


def _query(url: str, statement: str, params: tuple[Any, ...] = ()) -> list[Any]:
    conn = _connect(url, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(statement, params)
            return list(cur.fetchall())
    finally:
        conn.close()


def _id_of(url: str, event: Event) -> int:
    rows = _query(url, "SELECT id FROM outbox WHERE event_id = %s", (str(event.event_id),))
    assert rows, f"{event!r} was not committed"
    return int(rows[0][0])


def _ids_of_key(url: str, key: str) -> list[int]:
    return [
        int(r[0]) for r in _query(url, "SELECT id FROM outbox WHERE `key` = %s ORDER BY id", (key,))
    ]


def _lock_waiters(url: str) -> int:
    """Writes of the outbox blocked on another transaction's lock: InnoDB's LOCK WAIT, or an
    INSERT into the outbox still running while the only other writer sits idle in its
    transaction (the ordering assertions after it catch one that was merely slow). InnoDB
    does not always list the waiter: a one-slot key-lock read is a primary-key lookup the
    optimizer runs while planning (state "Statistics")."""
    rows = _query(
        url,
        "SELECT (SELECT COUNT(*) FROM information_schema.INNODB_TRX"
        " WHERE trx_state = 'LOCK WAIT') + (SELECT COUNT(*) FROM information_schema.PROCESSLIST"
        " WHERE command = 'Query' AND info LIKE 'INSERT INTO `outbox`%%')",
    )
    return int(rows[0][0])


def _wait_for_lock_waiters(
    url: str, writer: Background | None = None, timeout: float = 30.0
) -> None:
    """Until the server shows a transaction waiting for a lock. A writer that ended without
    waiting raises its own error (or says it committed) instead of a bare timeout."""
    deadline = time.monotonic() + timeout
    while _lock_waiters(url) < 1:
        if writer is not None and not writer.running():
            writer.join()
            raise AssertionError("the second writer committed without waiting for the key lock")
        assert time.monotonic() < deadline, "the second writer never waited for the key lock"
        time.sleep(0.02)


def _committed(url: str, write: Callable[[Any], None]) -> None:
    """``write(conn)`` in a transaction of its own, committed."""
    conn = _connect(url)
    try:
        write(conn)
        conn.commit()
    finally:
        conn.close()


def _put(url: str, ob: Outbox, e: Event) -> None:
    _committed(url, lambda conn: ob.put(conn, e))


def _put_many(url: str, ob: Outbox, e: Event) -> None:
    _committed(url, lambda conn: ob.put_many(conn, [_event(None), e, _event("other-key")]))


Writer = Callable[[str, Outbox, Event], None]
PATHS: dict[str, Writer] = {"put": _put, "put_many": _put_many}


def test_the_naive_write_lets_a_later_id_commit_first(url: str) -> None:
    """Seed 000's race, made deterministic: id order != commit order for one key."""
    outbox = Outbox(storage="mariadb")
    first, second = _event(n=1), _event(n=2)
    t1 = _connect(url)
    try:
        outbox.put(t1, first)  # T1 takes id n and stays open
        _put(url, outbox, second)  # T2 takes n + 1 and commits at once: nothing waits
        seen_while_t1_open = _ids_of_key(url, KEY)  # what a relay would publish now
        t1.commit()
    finally:
        t1.close()
    id1, id2 = _id_of(url, first), _id_of(url, second)
    assert id1 < id2
    assert seen_while_t1_open == [id2]  # committed first, with the larger id


@pytest.mark.parametrize("path", list(PATHS))
def test_an_ordered_write_waits_for_the_keys_earlier_writer(url: str, path: str) -> None:
    outbox = Outbox(storage="mariadb", ordered=True)
    first, second, bystander = _event(n=1), _event(n=2), _event(None, n=3)
    t1 = _connect(url)
    try:
        outbox.put(t1, first)  # T1: id n, the key's lock row held until it commits
        t2 = Background(PATHS[path], url, outbox, second)
        _wait_for_lock_waiters(url, t2)
        # While T2 waits, an unordered writer takes an id and commits: had T2 taken its
        # id before waiting for the lock, T2's id would come before this one.
        _put(url, Outbox(storage="mariadb"), bystander)
        time.sleep(0.1)
        assert t2.thread.is_alive()
        assert _ids_of_key(url, KEY) == []  # T2 has not committed ahead of T1
        t1.commit()
    finally:
        t1.close()
    t2.join()
    id1, id2, id3 = _id_of(url, first), _id_of(url, second), _id_of(url, bystander)
    assert id1 < id3 < id2
    assert _ids_of_key(url, KEY) == [id1, id2]


def test_the_lock_runs_before_any_row_of_the_statement_takes_its_id(url: str) -> None:
    """put_many with several keys: the last key's wait happens before the first row's id,
    and the rows keep the events' order."""
    outbox = Outbox(storage="mariadb", ordered=True)
    batch = [_event(None, n=1), _event("aa-first", n=2), _event("zz-last", n=3)]
    t1 = _connect(url)
    try:
        outbox.put(t1, _event("zz-last"))

        def write(url: str, ob: Outbox, _e: Event) -> None:
            _committed(url, lambda conn: ob.put_many(conn, batch))

        t2 = Background(write, url, outbox, batch[0])
        _wait_for_lock_waiters(url, t2)
        bystander = _event(None, n=4)
        _put(url, Outbox(storage="mariadb"), bystander)
        t1.commit()
    finally:
        t1.close()
    t2.join()
    after = _id_of(url, bystander)
    ids = [_id_of(url, e) for e in batch]
    assert all(i > after for i in ids)
    assert ids == sorted(ids)


def test_a_rolled_back_writer_frees_the_key(url: str) -> None:
    outbox = Outbox(storage="mariadb", ordered=True)
    t1 = _connect(url)
    try:
        outbox.put(t1, _event(n=1))
        t2 = Background(_put, url, outbox, second := _event(n=2))
        _wait_for_lock_waiters(url, t2)
        t1.rollback()
    finally:
        t1.close()
    t2.join()
    assert _ids_of_key(url, KEY) == [_id_of(url, second)]


def test_keyless_events_and_unordered_outboxes_take_no_lock(url: str) -> None:
    t1 = _connect(url)
    try:
        Outbox(storage="mariadb", ordered=True).put(t1, _event())  # holds the key's lock
        started = time.monotonic()
        _put_many(url, Outbox(storage="mariadb", ordered=True), _event(None))  # other keys
        _put(url, Outbox(storage="mariadb", ordered=True), _event(None))
        _put(url, Outbox(storage="mariadb"), _event())  # unordered: the same key, no wait
        assert time.monotonic() - started < 5
        assert _lock_waiters(url) == 0
        t1.rollback()
    finally:
        t1.close()


def test_an_ordered_write_on_an_outbox_not_migrated_for_it_says_what_to_run(
    mariadb_server: MariaDB,
) -> None:
    name = unique_name("plain")
    admin = pymysql.connect(**mariadb_server.connect_args(), autocommit=True)
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        url = mariadb_server.url_for(name)
        migrate(url)  # without --ordered
        conn = _connect(url)
        try:
            with pytest.raises(SchemaError, match=r"not set up for ordered mode.*--ordered"):
                Outbox(storage="mariadb", ordered=True).put(conn, _event())
            conn.rollback()
        finally:
            conn.close()
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")
    finally:
        admin.close()
