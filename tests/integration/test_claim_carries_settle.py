"""A claim carries the settle of the claim before it: one statement a cycle, not two.

At steady rates each claim finds a few events, and a claim and its settle each cost the
database about as much for 5 events as for 500. The relay now parks the settle of a claim
published whole while it waits to look again, and the claim that ends the wait settles it
in its own statement (queue/carry.py, backends/postgres/postgres.py CLAIM_SETTLING_*).
Counted here on a real PostgreSQL: statements, not timings.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import psycopg
import pytest

from outboxkit import Event, OutboundMessage, Outbox
from outboxkit.backends.postgres import _pg_session
from outboxkit.backends.postgres.queue_pg import PgQueueStore
from outboxkit.publishers.memory import MemoryBroker, MemoryPublisher
from outboxkit.relay.engine import Relay

_R = TypeVar("_R")


def _put(dsn: str, count: int, topic: str = "orders") -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        events = [Event(topic=topic, event_type="t", payload={"n": n}) for n in range(count)]
        Outbox().put_many(conn, events)


def _rows(dsn: str) -> list[tuple[int, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(int(r[0]), int(r[1])) for r in conn.execute("SELECT id, status FROM outbox")]


async def _claim(store: PgQueueStore[Any], **extra: Any) -> Any:
    args = {"limit": 100, "lease": 30.0, "token": uuid.uuid4(), "owner": "t", "max_attempts": 5}
    if "carried" in extra:
        return await store.claim_settling(extra["carried"], **args)
    return await store.claim(**args)


async def test_one_statement_claims_the_next_events_and_settles_the_last_claim(
    db_dsn: str,
) -> None:
    store: PgQueueStore[Any] = PgQueueStore(db_dsn, "outbox", OutboundMessage)
    try:
        _put(db_dsn, 3)
        first = await _claim(store)
        _put(db_dsn, 2)
        second, settled = await _claim(store, carried=first)
        assert list(settled.ids) == first.ids and settled.lost == 0
        assert second is not None and len(second.ids) == 2
        assert sorted(i for i, _ in _rows(db_dsn)) == second.ids  # the first three deleted
        # Nothing more to claim: the settle still goes through, the claim is None.
        third, settled = await _claim(store, carried=second)
        assert third is None and list(settled.ids) == second.ids
        assert _rows(db_dsn) == []
    finally:
        await store.close()


async def test_the_carried_settle_is_fenced_by_its_claims_token(db_dsn: str) -> None:
    store: PgQueueStore[Any] = PgQueueStore(db_dsn, "outbox", OutboundMessage)
    try:
        _put(db_dsn, 3)
        first = await _claim(store)
        taken = first.ids[1]
        with psycopg.connect(db_dsn, autocommit=True) as conn:  # another relay re-claimed one
            conn.execute("UPDATE outbox SET claim_token = gen_random_uuid() WHERE id = %s", [taken])
        claim, settled = await _claim(store, carried=first)
        assert claim is None
        assert sorted(settled.ids) == [i for i in first.ids if i != taken] and settled.lost == 1
        assert [i for i, _ in _rows(db_dsn)] == [taken]  # the other relay's row is left alone
        # A claim whose rows are all gone elsewhere settles none of them.
        _, settled = await _claim(store, carried=first)
        assert list(settled.ids) == [] and settled.lost == 3
    finally:
        await store.close()


async def test_with_retention_keep_the_carried_settle_marks_rows_published(db_dsn: str) -> None:
    store: PgQueueStore[Any] = PgQueueStore(db_dsn, "outbox", OutboundMessage, retention="keep")
    try:
        _put(db_dsn, 2)
        first = await _claim(store)
        claim, settled = await _claim(store, carried=first)
        assert claim is None and list(settled.ids) == first.ids
        assert sorted(_rows(db_dsn)) == [(first.ids[0], 1), (first.ids[1], 1)]  # published
    finally:
        await store.close()


async def _relay_statements(
    dsn: str, monkeypatch: pytest.MonkeyPatch, *, carry: bool, groups: int, size: int
) -> collections.Counter[str]:
    """Statements by kind while ``groups`` commits of ``size`` events each are relayed,
    one at a time (the next once the relay is idle again), as at a low rate: a claim,
    the linger's looks again, the wake-up gate, and the settle."""
    counts: collections.Counter[str] = collections.Counter()
    within = _pg_session.PgSession.within

    async def counting(self: Any, conn: Any, what: str, work: Awaitable[_R]) -> _R:
        counts[what] += 1
        return await within(self, conn, what, work)

    with monkeypatch.context() as patch:
        patch.setattr(_pg_session.PgSession, "within", counting)
        if not carry:  # the relay before: every settle a statement of its own
            patch.setattr(PgQueueStore, "carries_settles", property(lambda self: False))
        name = f"carry-{uuid.uuid4().hex[:8]}"
        broker = MemoryBroker.named(name)
        relay = Relay(dsn, MemoryPublisher(broker))
        running = asyncio.create_task(relay.run())
        try:
            await _until(lambda: counts["wake-up gate"] >= 1, running)  # idle, gate closed
            counts.clear()
            for n in range(1, groups + 1):
                await asyncio.to_thread(_put, dsn, size)
                await _until(lambda n=n: len(broker.messages) == n * size, running)
                await _until(lambda: not _rows(dsn), running)  # settled
                # Idle again (the wake-up gate opened after the claim, closed at the end
                # of the linger): each group then costs the same looks, both ways.
                await _until(lambda n=n: counts["wake-up gate"] == 2 * n, running)
            relay.stop()
            await asyncio.wait_for(running, 30)
        finally:
            relay.stop()
            MemoryBroker.forget(name)
    assert len(broker.messages) == groups * size  # each event published once
    return counts


async def _until(ok: Any, running: asyncio.Task[None], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not ok():
        if running.done():
            running.result()
            raise AssertionError("the relay stopped")
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_each_claim_and_settle_cycle_costs_one_statement_fewer(
    db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups, size = 10, 5
    before = await _relay_statements(db_dsn, monkeypatch, carry=False, groups=groups, size=size)
    after = await _relay_statements(db_dsn, monkeypatch, carry=True, groups=groups, size=size)
    # Before: every claim that found events was followed by a settle of its own.
    assert before["settle"] == groups
    # Now the claim that looks again a few ms later settles them (slack: a loaded machine
    # may publish slower than the linger's looks, and then one settles on its own).
    assert after["settle"] <= 2
    # Nothing else changed: the same gate statements, the same claims (give or take a look
    # again a loaded machine's timing adds): one statement fewer a cycle.
    assert after["wake-up gate"] == before["wake-up gate"] == 2 * groups
    assert after["claim"] <= before["claim"] + 3, (before, after)
    assert sum(after.values()) <= sum(before.values()) - groups + 4, (before, after)
