"""Outbox(ordered=True): for each key, the ids follow the commit order.

Seed 000's race: two transactions writing one key take ids n and n + 1 from the
identity sequence, and the one holding n + 1 commits first. A relay publishing in id
order has then already sent n + 1 when n appears. The naive write shows it here; the
ordered write makes the second writer wait for the first one's key lock, taken in the
same statement before its rows get their ids, so it takes n + 1 only after n committed.
Every write path is checked, with a third, unordered writer committing while the second
one waits: the waiting writer's id comes after it, so the lock ran before nextval().
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from outboxkit import Event, Outbox
from tests.integration.test_write import _client_round_trips

KEY = "order-42"


def _event(key: str | None = KEY, n: int = 0) -> Event:
    return Event(topic="orders", event_type="order.changed", payload={"n": n}, key=key)


def _id_of(dsn: str, event: Event) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT id FROM outbox WHERE event_id = %s", (event.event_id,)
        ).fetchone()
    assert row is not None, f"{event!r} was not committed"
    return int(row[0])


def _ids_of_key(dsn: str, key: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        cur = conn.execute("SELECT id FROM outbox WHERE key = %s ORDER BY id", (key,))
        return [int(r[0]) for r in cur]


def _lock_waiters(dsn: str) -> int:
    """Backends of this database waiting for an advisory lock."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _wait_for_lock_waiters(dsn: str, n: int = 1, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _lock_waiters(dsn) < n:
        assert time.monotonic() < deadline, "the second writer never waited for the key lock"
        time.sleep(0.02)


def _sa_url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://")


# -- every write path, as "commit one transaction holding `event`" ---------------------


def _put(dsn: str, ob: Outbox, e: Event) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        ob.put(conn, e)


def _put_many(dsn: str, ob: Outbox, e: Event) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        ob.put_many(conn, [_event(None), e, _event("other-key")])


def _execute_with(dsn: str, ob: Outbox, e: Event) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        ob.execute_with(conn, "SELECT %s::int", (1,), events=[e])


def _execute_with_many(dsn: str, ob: Outbox, e: Event) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        ob.execute_with(conn, "SELECT 1", events=[_event("other-key"), e])


def _transaction(dsn: str, ob: Outbox, e: Event) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, ob.transaction(conn) as tx:
        conn.execute("SELECT 1")
        tx.put(e)
        tx.put(_event(None))


def _transaction_unprepared(dsn: str, ob: Outbox, e: Event) -> None:
    # prepare_threshold=None (PgBouncer in transaction mode): the lock is parsed each time
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        with ob.transaction(conn) as tx:
            tx.put_many([e, _event("other-key")])


def _sqlalchemy_psycopg2(dsn: str, ob: Outbox, e: Event) -> None:
    # a generic DB-API driver: exec_driver_sql, the key list adapted by psycopg2
    engine = sa.create_engine(_sa_url(dsn, "psycopg2"), poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            ob.put_many(conn, [_event("other-key"), e])
    finally:
        engine.dispose()


def _sqlalchemy(dsn: str, ob: Outbox, e: Event) -> None:
    engine = sa.create_engine(_sa_url(dsn, "psycopg"), poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            ob.put(conn, e)
    finally:
        engine.dispose()


async def _aput(dsn: str, ob: Outbox, e: Event) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        await ob.aput(conn, e)


async def _atransaction(dsn: str, ob: Outbox, e: Event) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        async with ob.atransaction(conn) as tx:
            tx.put_many([_event("other-key"), e])


async def _asyncpg_aput_many(dsn: str, ob: Outbox, e: Event) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await ob.aput_many(conn, [e, _event(None)])
    finally:
        await conn.close()


async def _asyncpg_aexecute_with(dsn: str, ob: Outbox, e: Event) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await ob.aexecute_with(conn, "SELECT $1::int", (1,), events=[e])
    finally:
        await conn.close()


async def _sqlalchemy_async(dsn: str, ob: Outbox, e: Event) -> None:
    engine = create_async_engine(_sa_url(dsn, "asyncpg"), poolclass=sa.NullPool)
    try:
        async with engine.begin() as conn:
            await ob.aput(conn, e)
    finally:
        await engine.dispose()


Writer = Callable[[str, Outbox, Event], Any]
PATHS: dict[str, Writer] = {
    "put": _put,
    "put_many": _put_many,
    "execute_with": _execute_with,
    "execute_with (many)": _execute_with_many,
    "transaction": _transaction,
    "transaction (unprepared)": _transaction_unprepared,
    "sqlalchemy put": _sqlalchemy,
    "sqlalchemy psycopg2 put_many": _sqlalchemy_psycopg2,
    "aput (psycopg)": _aput,
    "atransaction": _atransaction,
    "aput_many (asyncpg)": _asyncpg_aput_many,
    "aexecute_with (asyncpg)": _asyncpg_aexecute_with,
    "aput (sqlalchemy asyncpg)": _sqlalchemy_async,
}


class Background:
    """Runs one writer in a thread (async ones in their own event loop)."""

    def __init__(self, write: Writer, dsn: str, ob: Outbox, event: Event) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                result = write(dsn, ob, event)
                if asyncio.iscoroutine(result):
                    asyncio.run(result)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 15.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the writer did not finish"
        if self.error is not None:
            raise self.error

    def running(self) -> bool:
        return self.thread.is_alive()


@pytest.fixture
def first_writer(db_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(db_dsn) as conn:
        yield conn


# -- the race, and how ordered mode closes it ---------------------------------------------


def test_the_naive_write_lets_a_later_id_commit_first(db_dsn: str) -> None:
    """Seed 000's race, made deterministic: id order != commit order for one key."""
    outbox = Outbox(ordered=False)
    first, second = _event(n=1), _event(n=2)
    with psycopg.connect(db_dsn) as t1:
        outbox.put(t1, first)  # T1 takes id n and stays open
        _put(db_dsn, outbox, second)  # T2 takes n + 1 and commits at once: nothing waits
        # A relay reading the key now publishes n + 1; n appears behind it later.
        seen_while_t1_open = _ids_of_key(db_dsn, KEY)
        t1.commit()
    id1, id2 = _id_of(db_dsn, first), _id_of(db_dsn, second)
    assert id1 < id2
    assert seen_while_t1_open == [id2]  # committed first, with the larger id


@pytest.mark.parametrize("path", list(PATHS))
def test_an_ordered_write_waits_for_the_keys_earlier_writer(
    db_dsn: str, first_writer: psycopg.Connection[Any], path: str
) -> None:
    outbox = Outbox(ordered=True)
    first, second, bystander = _event(n=1), _event(n=2), _event(None, n=3)
    outbox.put(first_writer, first)  # T1: id n, the key's lock held until it commits
    t2 = Background(PATHS[path], db_dsn, outbox, second)
    _wait_for_lock_waiters(db_dsn)
    # While T2 waits, an unordered writer takes an id and commits: had T2 taken its id
    # before waiting for the lock, T2's id would come before this one.
    _put(db_dsn, Outbox(), bystander)
    time.sleep(0.1)
    assert t2.running()
    assert _ids_of_key(db_dsn, KEY) == []  # T2 has not committed ahead of T1
    first_writer.commit()
    t2.join()
    id1, id2, id3 = _id_of(db_dsn, first), _id_of(db_dsn, second), _id_of(db_dsn, bystander)
    assert id1 < id3 < id2
    assert _ids_of_key(db_dsn, KEY) == [id1, id2]


def test_the_lock_runs_before_any_row_of_the_statement_takes_its_id(
    db_dsn: str, first_writer: psycopg.Connection[Any]
) -> None:
    """put_many with several keys: the last key's wait happens before the first row's id."""
    outbox = Outbox(ordered=True)
    outbox.put(first_writer, _event("zz-last"))
    batch = [_event(None, n=1), _event("aa-first", n=2), _event("zz-last", n=3)]

    def write(dsn: str, ob: Outbox, _e: Event) -> None:
        with psycopg.connect(dsn) as conn, conn.transaction():
            ob.put_many(conn, batch)

    t2 = Background(write, db_dsn, outbox, batch[0])
    _wait_for_lock_waiters(db_dsn)
    bystander = _event(None, n=4)
    _put(db_dsn, Outbox(), bystander)
    first_writer.commit()
    t2.join()
    after = _id_of(db_dsn, bystander)
    assert all(_id_of(db_dsn, e) > after for e in batch)


def test_keyless_events_and_unordered_outboxes_take_no_lock(
    db_dsn: str, first_writer: psycopg.Connection[Any]
) -> None:
    Outbox(ordered=True).put(first_writer, _event())  # holds the key's lock
    started = time.monotonic()
    _put_many(db_dsn, Outbox(ordered=True), _event(None))  # keyless only: no lock
    _put(db_dsn, Outbox(ordered=True), _event(None))
    _transaction(db_dsn, Outbox(ordered=True), _event(None))
    _put(db_dsn, Outbox(), _event())  # unordered: the same key, no wait
    _transaction(db_dsn, Outbox(), _event())
    assert time.monotonic() - started < 5
    assert _lock_waiters(db_dsn) == 0
    first_writer.rollback()


def test_every_spelling_of_the_table_takes_the_same_lock(
    db_dsn: str, first_writer: psycopg.Connection[Any]
) -> None:
    Outbox("outbox", ordered=True).put(first_writer, _event())
    t2 = Background(_put, db_dsn, Outbox("public.outbox", ordered=True), _event(n=2))
    _wait_for_lock_waiters(db_dsn)
    first_writer.commit()
    t2.join()


def test_the_ordered_write_keeps_its_round_trips(db_dsn: str) -> None:
    outbox = Outbox(ordered=True)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        with conn.transaction():
            sent = _client_round_trips(conn, lambda: outbox.put(conn, _event()))
        assert len(sent) == 1
        with conn.transaction():
            many = [_event(f"k{i}") for i in range(5)]
            assert len(_client_round_trips(conn, lambda: outbox.put_many(conn, many))) == 1

        def commit() -> None:
            with outbox.transaction(conn) as tx:
                tx.put_many([_event("a"), _event("b"), _event(None)])

        commit()  # prepares the lock and the INSERTs, in the same round trip
        # BEGIN when the block opens (autocommit connection), then one pipeline
        assert _client_round_trips(conn, commit) == ["Query", "Sync"]
        conn.pgconn.exec_(b"DEALLOCATE ALL")  # behind psycopg's back (a pooler's reset)
        with pytest.raises(psycopg.errors.InvalidSqlStatementName):
            commit()
        commit()  # and prepares again
        assert _client_round_trips(conn, commit) == ["Query", "Sync"]


# -- no deadlock between writers of overlapping key sets ------------------------------------

COUNTERS = """
CREATE TABLE key_commits (key text PRIMARY KEY, n int NOT NULL DEFAULT 0);
CREATE TABLE commit_log (event_id uuid PRIMARY KEY, key text NOT NULL, n int NOT NULL);
"""


def test_writers_of_overlapping_keys_in_any_order_never_deadlock_and_keep_commit_order(
    db_dsn: str,
) -> None:
    """8 threads write 5 of 8 keys per transaction, in a random order each time.

    put_many transactions bump a per-key counter after their INSERT: its row lock
    makes the counter's order the commit order of that key's writers, which must be
    the order of their ids. transaction() writers mix in (random key orders too).
    """
    keys = [f"acct-{i}" for i in range(8)]
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(COUNTERS)
        conn.execute("INSERT INTO key_commits (key) SELECT unnest(%s::text[])", (keys,))
    outbox = Outbox(ordered=True, notify=False)
    errors: list[BaseException] = []
    # OUTBOXKIT_TEST_ORDERED_WRITE_ROUNDS=2000 for a long run (25: ~2 s)
    rounds = int(os.environ.get("OUTBOXKIT_TEST_ORDERED_WRITE_ROUNDS", "25"))

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with psycopg.connect(db_dsn, autocommit=True) as conn:
                for i in range(rounds):
                    chosen = rng.sample(keys, 5)  # a random order, overlapping the others
                    events = [_event(k, n=i) for k in chosen]
                    if seed % 2:
                        with outbox.transaction(conn) as tx:
                            tx.put_many(events)
                        continue
                    with conn.transaction():
                        outbox.put_many(conn, events)
                        for e in sorted(events, key=lambda e: e.key or ""):
                            row = conn.execute(
                                "UPDATE key_commits SET n = n + 1 WHERE key = %s RETURNING n",
                                (e.key,),
                            ).fetchone()
                            assert row is not None
                            conn.execute(
                                "INSERT INTO commit_log VALUES (%s, %s, %s)",
                                (e.event_id, e.key, row[0]),
                            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120 + rounds)
    assert not any(t.is_alive() for t in threads)
    assert errors == []  # no DeadlockDetected, no lock timeout
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (8 * rounds * 5,)
        for key in keys:
            cur = conn.execute(
                "SELECT l.n FROM commit_log l JOIN outbox o USING (event_id)"
                " WHERE l.key = %s ORDER BY o.id",
                (key,),
            )
            commit_order = [r[0] for r in cur]
            assert commit_order == sorted(commit_order), key
