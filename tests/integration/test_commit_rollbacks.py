"""Rolled-back transactions never break the next ``Outbox.transaction()`` on the connection.

psycopg answers every ROLLBACK (and DROP, ALTER, DISCARD ALL) with ``DEALLOCATE ALL``
once it has auto-prepared a statement of its own (after ``prepare_threshold``
executions, 5 by default). That also drops outboxkit's prepared INSERT. Before the
fix, outboxkit still believed it prepared and the next transaction failed with
``InvalidSqlStatementName``: the caller's business transaction was lost (63 of about
3 000 with 20 % rollbacks). The invariant checked here, on one connection with
rollbacks interleaved with commits: every transaction meant to commit commits, with
exactly its events; nothing of a rolled-back one is stored.
"""

from __future__ import annotations

import json
import random
from typing import Any

import psycopg
import pytest

from outboxkit import Outbox
from tests.integration.test_write import _event
from tests.integration.test_write import shop_dsn as shop_dsn  # the fixture, shared
from tests.support.relaying import count, rows

ROUNDS = 300
ROLLBACK_SHARE = 0.2
# psycopg's default auto-prepare; a threshold it never reaches; no prepared statements.
THRESHOLDS = [5, 1_000_000, None]


class Rollback(Exception):
    pass


def _plan(seed: int) -> list[str]:
    """Which way each round ends: commit, or one of the ways an application rolls back."""
    rng = random.Random(seed)
    ways = ["block_raises", "outbox_block_raises", "explicit_rollback"]
    return [rng.choice(ways) if rng.random() < ROLLBACK_SHARE else "commit" for _ in range(ROUNDS)]


def _stored_orders(dsn: str) -> list[int]:
    return sorted(json.loads(bytes(r["payload"]))["order"] for r in rows(dsn))


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_rollbacks_interleaved_with_commits_never_fail_a_transaction(
    shop_dsn: str, threshold: int | None
) -> None:
    outbox = Outbox(notify=False)
    committed: list[int] = []
    with psycopg.connect(shop_dsn, autocommit=True, prepare_threshold=threshold) as conn:
        for i, way in enumerate(_plan(seed=1)):
            # The application's own statements, repeated: psycopg auto-prepares them.
            if way == "commit":
                with outbox.transaction(conn) as tx:
                    conn.execute("INSERT INTO orders (customer) VALUES (%s)", (f"c{i}",))
                    tx.put(_event(i))
                committed.append(i)
            elif way == "outbox_block_raises":
                with pytest.raises(Rollback), outbox.transaction(conn) as tx:
                    conn.execute("INSERT INTO orders (customer) VALUES (%s)", (f"c{i}",))
                    tx.put(_event(i))
                    raise Rollback
            elif way == "block_raises":
                with pytest.raises(Rollback), conn.transaction():
                    conn.execute("INSERT INTO orders (customer) VALUES (%s)", (f"c{i}",))
                    raise Rollback
            else:
                conn.execute("BEGIN")
                conn.execute("INSERT INTO orders (customer) VALUES (%s)", (f"c{i}",))
                conn.rollback()
    assert _stored_orders(shop_dsn) == committed
    assert count(shop_dsn, table="orders") == len(committed)


@pytest.mark.parametrize("threshold", THRESHOLDS)
async def test_async_rollbacks_interleaved_with_commits_never_fail_a_transaction(
    shop_dsn: str, threshold: int | None
) -> None:
    outbox = Outbox(notify=False)
    committed: list[int] = []
    conn = await psycopg.AsyncConnection.connect(
        shop_dsn, autocommit=True, prepare_threshold=threshold
    )
    async with conn:
        for i, way in enumerate(_plan(seed=2)):
            if way == "commit":
                async with outbox.atransaction(conn) as tx:
                    await conn.execute("INSERT INTO orders (customer) VALUES (%s)", (f"c{i}",))
                    tx.put(_event(i))
                committed.append(i)
            elif way == "outbox_block_raises":
                with pytest.raises(Rollback):
                    async with outbox.atransaction(conn) as tx:
                        await conn.execute("INSERT INTO orders (customer) VALUES (%s)", (f"c{i}",))
                        tx.put(_event(i))
                        raise Rollback
            elif way == "block_raises":
                with pytest.raises(Rollback):
                    async with conn.transaction():
                        await conn.execute("INSERT INTO orders (customer) VALUES (%s)", (f"c{i}",))
                        raise Rollback
            else:
                await conn.execute("BEGIN")
                await conn.execute("INSERT INTO orders (customer) VALUES (%s)", (f"c{i}",))
                await conn.rollback()
    assert _stored_orders(shop_dsn) == committed


def test_statements_that_make_psycopg_discard_its_cache_inside_the_block(shop_dsn: str) -> None:
    """DDL in the block makes psycopg queue a DEALLOCATE ALL for its next statement;
    the outbox flushes it before preparing, so its new statement is not dropped later."""
    outbox = Outbox(notify=False)
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        for i in range(6):
            conn.execute("SELECT %s::int", (i,))  # psycopg prepares this one
        for i in range(3):
            with outbox.transaction(conn) as tx:
                conn.execute(f"CREATE TEMP TABLE scratch_{i} (x int)")
                conn.execute(f"DROP TABLE scratch_{i}")
                tx.put(_event(i))
            conn.execute("SELECT %s::int", (i,))
    assert _stored_orders(shop_dsn) == [0, 1, 2]


def test_deallocate_all_through_psycopg_is_followed(shop_dsn: str) -> None:
    outbox = Outbox(notify=False)
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        with outbox.transaction(conn) as tx:
            tx.put(_event(1))
        conn.execute("DEALLOCATE ALL")
        with outbox.transaction(conn) as tx:
            tx.put(_event(2))
        conn.execute("DISCARD ALL")
        with outbox.transaction(conn) as tx:
            tx.put(_event(3))
    assert _stored_orders(shop_dsn) == [1, 2, 3]


def test_a_statement_lost_behind_psycopgs_back_fails_one_transaction_then_recovers(
    shop_dsn: str,
) -> None:
    """A pooler resetting the server session is invisible to the client: that one
    transaction fails cleanly (rolled back, error raised), the next prepares again."""
    outbox = Outbox(notify=False)
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        with outbox.transaction(conn) as tx:
            tx.put(_event(1))
        conn.pgconn.exec_(b"DEALLOCATE ALL")  # libpq directly: psycopg never sees it
        with pytest.raises(psycopg.errors.InvalidSqlStatementName), outbox.transaction(conn) as tx:
            conn.execute("INSERT INTO orders (customer) VALUES ('ada')")
            tx.put(_event(2))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with outbox.transaction(conn) as tx:
            conn.execute("INSERT INTO orders (customer) VALUES ('bob')")
            tx.put(_event(3))
    assert count(shop_dsn, table="orders") == 1
    assert _stored_orders(shop_dsn) == [1, 3]


def test_psycopg_evicting_the_statement_from_its_cache_is_followed(shop_dsn: str) -> None:
    """With more prepared statements than ``prepared_max``, psycopg deallocates the
    least recently used: when that is the outbox's, the next commit prepares it again."""
    outbox = Outbox(notify=False)
    evictions = 0
    with psycopg.connect(shop_dsn, autocommit=True, prepare_threshold=0) as conn:
        conn.prepared_max = 2
        for i in range(6):
            with outbox.transaction(conn) as tx:
                tx.put(_event(i))
            for j in range(3):  # three new statements push the outbox's out of the cache
                conn.execute(f"SELECT %s::int + {i * 10 + j}", (i,))
            evictions += not any(n.startswith("outboxkit_put_") for n in _names(conn))
    assert evictions >= 1  # psycopg did deallocate it, and the next commit prepared again
    assert _stored_orders(shop_dsn) == list(range(6))


def _names(conn: Any) -> list[str]:
    return [r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements")]
