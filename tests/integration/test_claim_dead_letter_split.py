"""The claim leaves crash-looping and oversized rows to a statement of its own.

The claim held a dead-lettering UPDATE that PostgreSQL set up at every claim, though it
almost never had a row: a part of the claim's fixed cost at steady rates (issue 42,
docs/benchmarks.md "The claim's fixed cost"). The claim now only names such rows (their
id, an empty last column) and the store dead-letters them with DEAD_LETTER right after,
which checks them again: between the two statements they are unlocked.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from outboxkit import Event, OutboundMessage, Outbox
from outboxkit.backends.postgres.postgres import Statements
from outboxkit.backends.postgres.queue_pg import PgQueueStore

SQL = Statements()


def _put(dsn: str, count: int) -> list[int]:
    with psycopg.connect(dsn) as conn, conn.transaction():
        events = [Event(topic="orders", event_type="t", payload={"n": n}) for n in range(count)]
        Outbox().put_many(conn, events)
        return [int(r[0]) for r in conn.execute("SELECT id FROM outbox ORDER BY id")]


def _params(max_attempts: int, relay: str) -> dict[str, Any]:
    return {"lease": 30.0, "token": uuid.uuid4(), "relay_id": relay, "limit": 100,
            "max_attempts": max_attempts, "commit": None}  # fmt: skip


def _row(conn: psycopg.Connection[Any], row_id: int) -> tuple[Any, ...]:
    row = conn.execute(
        "SELECT status, attempts, claimed_by, last_error FROM outbox WHERE id = %s", [row_id]
    ).fetchone()
    assert row is not None
    return tuple(row)


def test_the_claim_plans_one_update_only(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        for claim in (SQL.claim_batch, SQL.claim_settling_delete):
            params = _params(10, "plan") | {"settle_lo": 0, "settle_hi": 0,
                                            "settle_token": uuid.uuid4()}  # fmt: skip
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + claim, params))
            assert plan.count("Update on outbox") == 1, plan


async def test_the_store_dead_letters_what_the_claim_left(db_dsn: str) -> None:
    ids = _put(db_dsn, 3)
    looping = ids[1]
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        # Claimed twice by relays that died: over a max_attempts of 2.
        conn.execute(
            "UPDATE outbox SET attempts = 2, claim_token = gen_random_uuid() WHERE id = %s",
            [looping],
        )
        # The claim statement alone leaves it as it was and names it.
        with conn.transaction():
            got = conn.execute(SQL.claim_batch, _params(2, "raw")).fetchall()
            assert [(r[0], r[-1]) for r in got if r[-1] is not None] == [(looping, "")]
            assert _row(conn, looping)[:3] == (0, 2, None)
            raise psycopg.Rollback()
    store: PgQueueStore[Any] = PgQueueStore(db_dsn, "outbox", OutboundMessage)
    try:
        claim = await store.claim(
            limit=100, lease=30.0, token=uuid.uuid4(), owner="low", max_attempts=2
        )
    finally:
        await store.close()
    assert claim is not None and claim.ids == [ids[0], ids[2]]
    assert claim.dead is not None and [d[1] for d in claim.dead] == ["crash_loop"]
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        status, attempts, by, error = _row(conn, looping)
    assert (status, attempts, by) == (2, 2, "low")
    assert error.startswith("relay: claimed 2 times (max_attempts) and never settled")


def test_a_row_claimed_between_the_two_statements_is_left_alone(db_dsn: str) -> None:
    """The naive way, dead-lettering the ids the claim named as they are, fails a row
    another relay (a higher max_attempts) claimed meanwhile and is publishing."""
    ids = _put(db_dsn, 1)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET attempts = 2 WHERE id = %s", [ids[0]])
        low = _params(2, "low")
        named = [r[0] for r in conn.execute(SQL.claim_batch, low).fetchall() if r[-1] == ""]
        assert named == ids
        high = _params(10, "high")
        assert [r[0] for r in conn.execute(SQL.claim_batch, high).fetchall()] == ids
        with conn.transaction():  # the naive statement would fail the claimed row
            naive = conn.execute(
                "UPDATE outbox SET status = 2 WHERE id = ANY(%s) AND attempts >= 2", [named]
            )
            assert naive.rowcount == 1
            raise psycopg.Rollback()
        assert conn.execute(SQL.dead_letter, low | {"dead": named}).fetchall() == []
        assert _row(conn, ids[0])[:3] == (0, 3, "high")  # still the higher relay's claim
