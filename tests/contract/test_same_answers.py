"""The in-memory store answers as PostgreSQL's does: one random sequence of operations on both.

Scenarios (test_queue_store.py) pin each rule; this runs many of them interleaved, as a
relay's life mixes them: writes, claims by two claimers (HeadsOnly in ordered mode),
settles of any decision, stale settles, extensions, releases, hastens, partition
hand-overs and time passing. After every step both backends must have given the same
answer, and their tables must agree item by item (status, attempts, token, claimer,
error, due or not).

The memory queue's clock runs with real time (plus what ``advance`` adds), as
PostgreSQL's ``now()`` does; every delay, lease and step of time is a multiple of 10 s,
so the milliseconds between the two backends' statements never decide anything.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest

from outboxkit.publishers.base import OutboundMessage
from outboxkit.queue.memory import ManualClock
from outboxkit.queue.store import DONE, Claim, ClaimPolicy, Decision, HeadsOnly, Verdict
from tests.contract.backends import PARTITIONS, Backend, MemoryBackend, PostgresBackend

STEPS = 120
LEASE = 30.0
MAX_ATTEMPTS = 3
OWNERS = ("relay-a", "relay-b")
#: Ordered mode's members (one case: PostgreSQL sorts them by its collation).
RELAYS = ("relay-a", "relay-b", "relay-c")


class _RunningClock(ManualClock):
    """Real time plus what :meth:`advance` added (PostgreSQL's now() with stored times shifted)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self._start = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self._start + self.now


@pytest.fixture(params=[False, True], ids=["unordered", "ordered"])
async def pair(
    request: pytest.FixtureRequest, db_dsn: str
) -> AsyncIterator[tuple[Backend, Backend]]:
    ordered: bool = request.param
    pg = PostgresBackend(db_dsn, ordered)
    memory = MemoryBackend(ordered, clock=_RunningClock())
    try:
        yield memory, pg
    finally:
        await memory.close()
        await pg.close()


def _decision(rng: random.Random) -> Decision:
    return rng.choice(
        [
            DONE,
            Decision(Verdict.RETRY, rng.choice([0.0, 10.0, 20.0]), "try again"),
            Decision(Verdict.DEAD, 0.0, "rejected"),
            Decision(Verdict.HAND_BACK, rng.choice([0.0, 10.0]), "handed back"),
        ]
    )


class _Life:
    """One random life, lived by both backends step by step (0: memory, 1: PostgreSQL)."""

    def __init__(self, memory: Backend, pg: Backend, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ordered = memory.ordered
        self.backends = (memory, pg)
        retention: Literal["delete", "keep"] = "keep" if seed % 2 == 0 else "delete"
        self.stores = [[b.store(retention=retention) for _ in OWNERS] for b in self.backends]
        # Item ids per backend, mapped to a shared index (the order they were written in).
        self.index: tuple[dict[int, int], dict[int, int]] = ({}, {})
        self.ids: tuple[list[int], list[int]] = ([], [])
        self.claims: list[tuple[Claim[OutboundMessage], Claim[OutboundMessage], int]] = []
        self.log: list[str] = []

    def _shape(self, b: int, claim: Claim[OutboundMessage] | None) -> Any:
        """A claim as comparable across backends: (item index, attempt, n) per item."""
        if claim is None:
            return None
        items = zip(claim.ids, claim.items, strict=True)
        number = self.backends[b].number
        dead = sorted((number(item), item.attempt, kind, error) for item, kind, error in claim.dead)
        return [(self.index[b][i], item.attempt, number(item)) for i, item in items], dead

    async def put(self) -> tuple[Any, Any]:
        key = self.rng.choice(["a", "b", "c", None] if self.ordered else [None])
        delay = self.rng.choice([0.0, 0.0, 0.0, 10.0])
        n = len(self.ids[0])
        self.log.append(f"put {n} key={key} delay={delay}")
        for b, backend in enumerate(self.backends):
            item_id = await backend.put(n, key=key, delay=delay)
            self.index[b][item_id] = n
            self.ids[b].append(item_id)
        return None, None

    async def claim(self) -> tuple[Any, Any]:
        s = self.rng.randrange(len(OWNERS))
        limit = self.rng.randint(1, 5)
        policy: ClaimPolicy = None
        if self.ordered and self.rng.random() < 0.8:
            policy = HeadsOnly(
                block=self.rng.random() < 0.7,
                margin=self.rng.choice([0.0, 5.0]),
                draining=sorted(self.rng.sample(range(PARTITIONS), self.rng.randint(0, 2))),
            )
        token = uuid.uuid4()
        max_attempts = self.rng.choice([MAX_ATTEMPTS, MAX_ATTEMPTS, MAX_ATTEMPTS + 1])
        self.log.append(f"claim by {OWNERS[s]} limit={limit} {max_attempts=} {policy}")
        got = [
            await self.stores[b][s].claim(
                limit=limit,
                lease=LEASE,
                token=token,
                owner=OWNERS[s],
                max_attempts=max_attempts,
                policy=policy,
            )
            for b in (0, 1)
        ]
        if got[0] is not None and got[1] is not None:
            self.claims.append((got[0], got[1], s))
        return self._shape(0, got[0]), self._shape(1, got[1])

    async def settle(self) -> tuple[Any, Any]:
        if not self.claims:
            return None, None
        k = self.rng.randrange(len(self.claims))
        *claims, s = self.claims[k]
        decisions = [_decision(self.rng) for _ in claims[0].ids]
        self.log.append(f"settle claim {k} {[d.verdict.value for d in decisions]}")
        answers = []
        for b in (0, 1):
            settled = await self.stores[b][s].settle(claims[b], decisions)
            answers.append((sorted(self.index[b][i] for i in settled.ids), settled.lost))
        self._forget(k)
        return answers[0], answers[1]

    async def extend(self) -> tuple[Any, Any]:
        if not self.claims:
            return None, None
        k = self.rng.randrange(len(self.claims))
        *claims, s = self.claims[k]
        self.log.append(f"extend claim {k}")
        answers = [await self.stores[b][s].extend_leases(claims[b], LEASE) for b in (0, 1)]
        return answers[0], answers[1]

    async def release(self) -> tuple[Any, Any]:
        if not self.claims:
            return None, None
        k = self.rng.randrange(len(self.claims))
        *claims, s = self.claims[k]
        self.log.append(f"release claim {k}")
        answers = [await self.stores[b][s].release(claims[b]) for b in (0, 1)]
        self._forget(k)
        return answers[0], answers[1]

    def _forget(self, k: int) -> None:
        if self.rng.random() < 0.5:  # the others stay: a later settle of one is stale
            self.claims.pop(k)

    async def hasten(self) -> tuple[Any, Any]:
        chosen = self.rng.sample(range(len(self.ids[0])), min(3, len(self.ids[0])))
        self.log.append(f"hasten {chosen}")
        answers = [await self.stores[b][0].hasten([self.ids[b][i] for i in chosen]) for b in (0, 1)]
        return answers[0], answers[1]

    async def advance(self) -> tuple[Any, Any]:
        seconds = self.rng.choice([10.0, 20.0, 40.0])
        self.log.append(f"advance {seconds}")
        for backend in self.backends:
            await backend.advance(seconds)
        return None, None

    async def hold(self) -> tuple[Any, Any]:
        owner = self.rng.choice(OWNERS)
        wanted = sorted(self.rng.sample(range(PARTITIONS), self.rng.randint(1, PARTITIONS)))
        lease = self.rng.choice([30.0, 60.0])
        self.log.append(f"partitions {wanted} to {owner} for {lease}")
        answers = [await b.hold_partitions(owner, lease, wanted) for b in self.backends]
        return answers[0], answers[1]

    async def beat(self) -> tuple[Any, Any]:
        relay = self.rng.choice(RELAYS)
        if self.rng.random() < 0.2:
            self.log.append(f"{relay} leaves")
            for backend in self.backends:
                await backend.leave(relay)
            return None, None
        lease = self.rng.choice([30.0, 60.0])
        self.log.append(f"{relay} beats for {lease}")
        answers = [await backend.heartbeat(relay, lease) for backend in self.backends]
        return answers[0], answers[1]

    async def tables(self) -> list[dict[int, Any]]:
        return [
            {self.index[b][i]: r.state() for i, r in (await backend.table()).items()}
            for b, backend in enumerate(self.backends)
        ]


async def test_keys_land_in_the_same_partitions_on_both_backends(db_dsn: str) -> None:
    """The memory queue hashes keys as PostgreSQL's ``partition`` column does (hashtext)."""
    pg = PostgresBackend(db_dsn, ordered=True)
    memory = MemoryBackend(ordered=True)
    keys = ["", "a", "k0", "order-42", "é", "ключ", "🙂 x", "x" * 11, "y" * 12, "z" * 13, "w" * 40]
    try:
        for key in keys:
            item_id = await pg.put(0, key=key)
            row = pg.conn.execute("SELECT partition FROM outbox WHERE id = %s", (item_id,))
            assert memory.queue.partition_of(key) == row.fetchone()[0], key  # type: ignore[index]
    finally:
        await pg.close()


async def test_the_claims_own_dead_letters_read_the_same_on_both_backends(db_dsn: str) -> None:
    """Word for word: the crash-loop guard's two verdicts, with the last real error kept."""
    pg = PostgresBackend(db_dsn, ordered=False)
    memory = MemoryBackend(ordered=False, clock=_RunningClock())
    try:
        answers = []
        for backend in (memory, pg):
            looping, retried = await backend.put(0), await backend.put(1)
            store = backend.store()
            token = uuid.uuid4()
            for _ in range(MAX_ATTEMPTS):
                got = await store.claim(
                    limit=2, lease=LEASE, token=token, owner="a", max_attempts=MAX_ATTEMPTS + 2
                )
                assert got is not None and got.ids == [looping, retried]
                await store.settle(got, [Decision(Verdict.RETRY, 0.0, "HTTP 500")] * 2)
                await backend.advance(10)
            got = await store.claim(limit=1, lease=LEASE, token=token, owner="a", max_attempts=9)
            assert got is not None and got.ids == [looping]  # it leaves its token behind
            await backend.advance(LEASE + 10)
            got = await store.claim(
                limit=2, lease=LEASE, token=token, owner="b", max_attempts=MAX_ATTEMPTS
            )
            assert got is not None and got.ids == []
            dead = sorted((backend.number(i), i.attempt, k, e) for i, k, e in got.dead)
            rows = [(await backend.row(i)) for i in (looping, retried)]
            answers.append((dead, [r.state() if r else None for r in rows]))
        assert answers[0] == answers[1]
        assert [kind for _n, _a, kind, _e in answers[0][0]] == ["crash_loop", "max_attempts"]
    finally:
        await memory.close()
        await pg.close()


async def test_ordered_membership_reads_the_same_on_both_backends(db_dsn: str) -> None:
    """Heartbeats, expiry and leaving: the members each heartbeat returns."""
    pg = PostgresBackend(db_dsn, ordered=True)
    memory = MemoryBackend(ordered=True, clock=_RunningClock())
    script: list[tuple[str, str]] = [
        ("beat", "relay-a"),
        ("beat", "relay-b"),
        ("advance", "20"),
        ("beat", "relay-c"),
        ("leave", "relay-a"),
        ("beat", "relay-b"),
        ("advance", "20"),
        ("beat", "relay-b"),
        ("advance", "40"),
        ("beat", "relay-b"),
    ]
    try:
        answers = []
        for backend in (memory, pg):
            members = []
            for what, arg in script:
                if what == "beat":
                    members.append(await backend.heartbeat(arg, 30.0))
                elif what == "leave":
                    await backend.leave(arg)
                else:
                    await backend.advance(float(arg))
            answers.append(members)
        assert (
            answers[0]
            == answers[1]
            == [
                ["relay-a"],
                ["relay-a", "relay-b"],
                ["relay-a", "relay-b", "relay-c"],
                ["relay-b", "relay-c"],
                ["relay-b", "relay-c"],
                ["relay-b"],
            ]
        )
    finally:
        await memory.close()
        await pg.close()


@pytest.mark.parametrize("seed", [1, 2])
async def test_one_random_life_gives_the_same_answers_and_table_on_both_backends(
    pair: tuple[Backend, Backend], seed: int
) -> None:
    life = _Life(*pair, seed)
    ops = {
        life.put: 5,
        life.claim: 5,
        life.settle: 4,
        life.extend: 1,
        life.release: 1,
        life.hasten: 1,
        life.advance: 2,
        life.hold: 1 if life.ordered else 0,
        life.beat: 1 if life.ordered else 0,
    }
    for step in range(STEPS):
        op = life.rng.choices(list(ops), weights=list(ops.values()))[0]
        memory_answer, pg_answer = await op()
        where = f"step {step}: {life.log[-1:]}; the steps: {life.log}"
        assert memory_answer == pg_answer, where
        memory_table, pg_table = await life.tables()
        assert memory_table == pg_table, where
    statuses = {row[0] for row in (await life.tables())[1].values()}
    assert len(life.ids[0]) > 20 and "failed" in statuses  # the life went through the states
