"""The queue store contract: one scenario per rule of outboxkit.queue.store, every backend.

River's driver conformance suite is the model: a backend is proven by passing these,
PostgreSQL (the reference) and the in-memory store alike. Scenarios speak only through
the store interface; the harness (tests/contract/backends.py) writes items, reads their
state and moves time.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from outboxkit.publishers.base import OutboundMessage
from outboxkit.queue.store import DONE, Claim, ClaimPolicy, Decision, HeadsOnly, Verdict
from tests.contract.backends import PARTITIONS, Backend, Store

LEASE = 30.0
MAX_ATTEMPTS = 3
#: Slack for times read back from PostgreSQL, whose clock runs while a scenario does.
SLACK = 2.0


async def claim(
    store: Store,
    *,
    limit: int = 100,
    owner: str = "relay-a",
    lease: float = LEASE,
    policy: ClaimPolicy = None,
    max_attempts: int = MAX_ATTEMPTS,
) -> Claim[OutboundMessage] | None:
    return await store.claim(
        limit=limit,
        lease=lease,
        token=uuid.uuid4(),
        owner=owner,
        max_attempts=max_attempts,
        policy=policy,
    )


async def claimed_ids(store: Store, **options: object) -> list[int]:
    got = await claim(store, **options)  # type: ignore[arg-type]
    return [] if got is None else got.ids


def retry(delay: float, error: str = "broker said no") -> Decision:
    return Decision(Verdict.RETRY, delay, error)


# -- claim ---------------------------------------------------------------------------------


async def test_a_claim_leases_due_items_in_id_order_and_counts_an_attempt(
    backend: Backend,
) -> None:
    ids = await backend.put_many(3)
    store = backend.store()
    got = await claim(store, owner="relay-a")
    assert got is not None
    assert got.ids == ids
    assert [backend.number(i) for i in got.items] == [0, 1, 2]
    assert [i.attempt for i in got.items] == [1, 1, 1]
    for item_id in ids:
        row = await backend.row(item_id)
        assert row is not None
        assert (row.status, row.attempts, row.claim_token, row.claimed_by) == (
            "pending",
            1,
            got.token,
            "relay-a",
        )
        assert LEASE - SLACK < row.due_in <= LEASE


async def test_a_claim_takes_at_most_its_limit_and_returns_none_when_nothing_is_due(
    backend: Backend,
) -> None:
    ids = await backend.put_many(5)
    store = backend.store()
    assert await claimed_ids(store, limit=2) == ids[:2]
    assert await claimed_ids(store, limit=2) == ids[2:4]
    assert await claimed_ids(store, limit=2) == ids[4:]
    assert await claim(store) is None


async def test_due_items_go_by_due_time_then_id(backend: Backend) -> None:
    later = await backend.put(0, delay=5)
    sooner = await backend.put(1)
    await backend.advance(10)
    store = backend.store()
    assert await claimed_ids(store, limit=1) == [sooner]
    assert await claimed_ids(store, limit=1) == [later]


async def test_concurrent_claimers_claim_every_item_exactly_once(backend: Backend) -> None:
    ids = await backend.put_many(120)
    stores = [backend.store() for _ in range(6)]

    async def drain(store: Store, owner: str) -> list[int]:
        taken: list[int] = []
        while (got := await claim(store, limit=7, owner=owner)) is not None:
            taken += got.ids
        return taken

    takes = await asyncio.gather(*(drain(s, f"relay-{n}") for n, s in enumerate(stores)))
    every = [item_id for taken in takes for item_id in taken]
    assert sorted(every) == ids  # each once: none twice, none missed


# -- leases and fencing ----------------------------------------------------------------------


async def test_a_leased_item_is_claimable_again_only_once_its_lease_ran_out(
    backend: Backend,
) -> None:
    (item_id,) = await backend.put_many(1)
    first, second = backend.store(), backend.store()
    assert await claimed_ids(first, owner="relay-a") == [item_id]
    await backend.advance(LEASE - 5)
    assert await claim(second, owner="relay-b") is None
    await backend.advance(10)
    again = await claim(second, owner="relay-b")
    assert again is not None and again.ids == [item_id]
    assert again.items[0].attempt == 2
    row = await backend.row(item_id)
    assert row is not None and (row.claim_token, row.claimed_by) == (again.token, "relay-b")


async def test_a_stale_claim_settles_extends_and_releases_nothing(backend: Backend) -> None:
    ids = await backend.put_many(2)
    first, second = backend.store(), backend.store()
    stale = await claim(first, owner="relay-a")
    assert stale is not None
    await backend.advance(LEASE + 1)
    fresh = await claim(second, owner="relay-b")
    assert fresh is not None and fresh.ids == ids

    settled = await first.settle(stale, [DONE, retry(0)])
    assert (list(settled.ids), settled.lost) == ([], 2)
    assert await first.extend_leases(stale, 600) == 0
    assert await first.release(stale) == 0
    for item_id in ids:
        row = await backend.row(item_id)
        assert row is not None
        assert (row.status, row.attempts, row.claim_token) == ("pending", 2, fresh.token)
        assert LEASE - SLACK < row.due_in <= LEASE

    settled = await second.settle(fresh, [DONE, DONE])
    assert (sorted(settled.ids), settled.lost) == (ids, 0)


async def test_a_claim_whose_lease_ran_out_unclaimed_still_settles(backend: Backend) -> None:
    (item_id,) = await backend.put_many(1)
    store = backend.store()
    late = await claim(store)
    assert late is not None
    await backend.advance(LEASE + 1)  # nobody re-claimed it: the token still names it
    settled = await store.settle(late, [DONE])
    assert (list(settled.ids), settled.lost) == ([item_id], 0)
    assert await backend.row(item_id) is None


async def test_a_second_settle_of_one_claim_changes_nothing(backend: Backend) -> None:
    (item_id,) = await backend.put_many(1)
    store = backend.store()
    got = await claim(store)
    assert got is not None
    assert (await store.settle(got, [retry(60, "first")])).lost == 0
    settled = await store.settle(got, [Decision(Verdict.DEAD, 0, "second")])
    assert (list(settled.ids), settled.lost) == ([], 1)
    row = await backend.row(item_id)
    assert row is not None and (row.status, row.last_error) == ("pending", "first")


async def test_extend_leases_keeps_the_items_leased(backend: Backend) -> None:
    ids = await backend.put_many(2)
    store, other = backend.store(), backend.store()
    got = await claim(store)
    assert got is not None
    await backend.advance(LEASE - 5)
    assert await store.extend_leases(got, LEASE) == 2
    await backend.advance(10)  # past the first lease, within the extended one
    assert await claim(other, owner="relay-b") is None
    for item_id in ids:
        row = await backend.row(item_id)
        assert row is not None and LEASE - 10 - SLACK < row.due_in <= LEASE - 10


async def test_release_hands_the_items_back_at_once_with_the_attempt_refunded(
    backend: Backend,
) -> None:
    ids = await backend.put_many(2)
    store, other = backend.store(), backend.store()
    got = await claim(store)
    assert got is not None
    assert await store.release(got) == 2
    for item_id in ids:
        row = await backend.row(item_id)
        assert row is not None
        assert (row.status, row.attempts, row.claim_token) == ("pending", 0, None)
    again = await claim(other, owner="relay-b")
    assert again is not None and again.ids == ids
    assert [i.attempt for i in again.items] == [1, 1]


# -- settle ----------------------------------------------------------------------------------


async def test_settle_applies_each_decision_to_its_own_item(backend: Backend) -> None:
    done, retried, dead, handed_back = await backend.put_many(4)
    store = backend.store()
    got = await claim(store)
    assert got is not None
    decisions = [
        DONE,
        retry(60, "timed out"),
        Decision(Verdict.DEAD, 0, "too large for the broker"),
        Decision(Verdict.HAND_BACK, 5, "broker down"),
    ]
    settled = await store.settle(got, decisions)
    assert (sorted(settled.ids), settled.lost) == (got.ids, 0)

    assert await backend.row(done) is None  # retention delete
    row = await backend.row(retried)
    assert row is not None
    assert (row.status, row.attempts, row.claim_token, row.last_error) == (
        "pending",
        1,
        None,
        "timed out",
    )
    assert 60 - SLACK < row.due_in <= 60
    row = await backend.row(dead)
    assert row is not None
    assert (row.status, row.attempts, row.claim_token, row.last_error) == (
        "failed",
        1,
        None,
        "too large for the broker",
    )
    row = await backend.row(handed_back)
    assert row is not None
    assert (row.status, row.attempts, row.claim_token) == ("pending", 0, None)
    assert 5 - SLACK < row.due_in <= 5


async def test_retention_keep_marks_processed_items_published(backend: Backend) -> None:
    ids = await backend.put_many(2)
    store = backend.store(retention="keep")
    got = await claim(store)
    assert got is not None
    assert (await store.settle(got, [DONE, DONE])).lost == 0
    for item_id in ids:
        row = await backend.row(item_id)
        assert row is not None
        assert (row.status, row.attempts, row.claim_token, row.last_error) == (
            "published",
            1,
            None,
            None,
        )
    assert await claim(store) is None


async def test_a_retried_item_waits_for_its_delay(backend: Backend) -> None:
    (item_id,) = await backend.put_many(1)
    store = backend.store()
    got = await claim(store)
    assert got is not None
    await store.settle(got, [retry(20)])
    await backend.advance(15)
    assert await claim(store) is None
    await backend.advance(10)
    again = await claim(store)
    assert again is not None and again.ids == [item_id] and again.items[0].attempt == 2


async def test_attempts_count_every_claim_up_to_the_dead_letter(backend: Backend) -> None:
    (item_id,) = await backend.put_many(1)
    store = backend.store()
    attempts = []
    while (got := await claim(store)) is not None:
        attempt = got.items[0].attempt
        attempts.append(attempt)
        last = attempt >= MAX_ATTEMPTS
        await store.settle(got, [Decision(Verdict.DEAD, 0, "gave up") if last else retry(0)])
    assert attempts == [1, 2, 3]
    row = await backend.row(item_id)
    assert row is not None and (row.status, row.attempts, row.last_error) == (
        "failed",
        MAX_ATTEMPTS,
        "gave up",
    )


async def test_the_crash_loop_guard_dead_letters_an_item_no_claimer_ever_settled(
    backend: Backend,
) -> None:
    looping = await backend.put(0)
    store = backend.store()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        got = await claim(store)
        assert got is not None and got.ids == [looping] and got.items[0].attempt == attempt
        await backend.advance(LEASE + 1)  # the claimer died holding it
    fine = await backend.put(1)
    got = await claim(store, owner="relay-z")
    assert got is not None and got.ids == [fine]
    row = await backend.row(looping)
    assert row is not None
    assert (row.status, row.attempts, row.claim_token, row.claimed_by) == (
        "failed",
        MAX_ATTEMPTS,
        None,
        "relay-z",
    )
    assert row.last_error is not None and "never settled" in row.last_error
    # the claim reports what it dead-lettered (counted and logged like every dead letter)
    assert [(backend.number(item), kind, error) for item, kind, error in got.dead] == [
        (0, "crash_loop", row.last_error)
    ]


async def test_a_claim_that_found_only_dead_items_still_reports_them(backend: Backend) -> None:
    looping = await backend.put(0)
    store = backend.store()
    for _ in range(MAX_ATTEMPTS):
        await claim(store)
        await backend.advance(LEASE + 1)
    got = await claim(store)
    assert got is not None and got.ids == [] and len(got.dead) == 1
    assert await backend.row(looping) is not None
    assert await claim(store) is None


async def test_an_item_retried_up_to_a_higher_max_attempts_is_dead_lettered_by_the_claim(
    backend: Backend,
) -> None:
    item_id = await backend.put(0)
    patient, strict = backend.store(), backend.store()
    for _ in range(MAX_ATTEMPTS):
        got = await claim(patient, max_attempts=MAX_ATTEMPTS + 2)
        assert got is not None
        await patient.settle(got, [retry(0, "HTTP 500")])
    got = await claim(strict, max_attempts=MAX_ATTEMPTS)
    assert got is not None and got.ids == []
    ((item, kind, error),) = got.dead
    assert (backend.number(item), item.attempt, kind) == (0, MAX_ATTEMPTS, "max_attempts")
    assert error.startswith(f"relay: tried {MAX_ATTEMPTS} times already")
    assert error.endswith("Last error: HTTP 500")  # the real cause survives
    row = await backend.row(item_id)
    assert row is not None and (row.status, row.last_error) == ("failed", error)


async def test_hasten_makes_handed_back_items_due_now_and_leaves_claimed_ones(
    backend: Backend,
) -> None:
    waiting, leased = await backend.put_many(2)
    store = backend.store()
    got = await claim(store, limit=1)
    assert got is not None and got.ids == [waiting]
    await store.settle(got, [Decision(Verdict.HAND_BACK, 60, "broker down")])
    assert await claimed_ids(store) == [leased]
    assert await store.hasten([waiting, leased]) == 1
    row = await backend.row(waiting)
    assert row is not None and row.due_in <= 0 and row.attempts == 0
    assert await claimed_ids(store) == [waiting]


# -- scheduled items ---------------------------------------------------------------------------


async def test_a_scheduled_item_is_claimed_only_from_its_time(backend: Backend) -> None:
    scheduled = await backend.put(0, delay=60)
    now = await backend.put(1)
    store = backend.store()
    got = await claim(store)
    assert got is not None and got.ids == [now]
    await store.settle(got, [DONE])
    await backend.advance(50)
    assert await claim(store) is None
    await backend.advance(15)
    assert await claimed_ids(store) == [scheduled]


# -- the wake-up gate ---------------------------------------------------------------------------


async def test_one_claimer_at_a_time_holds_the_wake_up_gate(backend: Backend) -> None:
    first, second = backend.store(), backend.store()
    assert await first.close_gate() is True
    assert first.gate_closed and not second.gate_closed
    assert await second.close_gate() is False
    await first.open_gate()
    assert not first.gate_closed
    assert await second.close_gate() is True
    assert second.gate_closed


async def test_writes_wake_a_listener_only_while_the_gate_is_closed_and_only_when_due(
    backend: Backend,
) -> None:
    store = backend.store()
    assert store.can_listen
    wakes = 0
    woken = asyncio.Event()

    def wake() -> None:
        nonlocal wakes
        wakes += 1
        woken.set()

    async def woken_once_more() -> int:
        await asyncio.wait_for(woken.wait(), timeout=10)
        woken.clear()
        return wakes

    listening = asyncio.create_task(store.listen(wake))
    try:
        assert await woken_once_more() == 1  # on listening: whatever came meanwhile
        await backend.put(0)  # nobody waits at the gate: no wake-up
        await backend.put(1, delay=60)  # not due: no wake-up even with the gate closed
        assert await store.close_gate()
        await backend.put(2, delay=60)
        await backend.put(3)
        assert await woken_once_more() == 2  # only the last write woke it
    finally:
        listening.cancel()
        await asyncio.gather(listening, return_exceptions=True)


async def test_start_counts_the_pending_items(backend: Backend) -> None:
    await backend.put_many(3)
    info = await backend.store().start()
    assert (info.pending, info.pending_capped) == (3, False)


# -- ordered heads (HeadsOnly) ----------------------------------------------------------------

HEADS = HeadsOnly()


async def test_ordered_a_key_in_flight_has_none_of_its_later_items_claimed(
    ordered_backend: Backend,
) -> None:
    b = ordered_backend
    a1, b1, a2, free, b2, a3 = [
        await b.put(n, key=key) for n, key in enumerate(["a", "b", "a", None, "b", "a"])
    ]
    assert len(await b.hold_partitions("relay-a")) > 0
    store = b.store()
    assert await claimed_ids(store, limit=1, policy=HEADS) == [a1]
    # a's head is in flight: b's items and the keyless one are claimable, a's later ones not
    assert await claimed_ids(store, policy=HEADS) == [b1, free, b2]
    assert await claim(store, policy=HEADS) is None
    await b.advance(LEASE + 1)  # a's head comes back: a whole prefix of a goes together
    assert await claimed_ids(store, policy=HEADS) == [a1, b1, a2, free, b2, a3]


async def test_ordered_a_retrying_head_holds_back_its_key_only(ordered_backend: Backend) -> None:
    b = ordered_backend
    a1, a2, b1 = [await b.put(n, key=key) for n, key in enumerate(["a", "a", "b"])]
    await b.hold_partitions("relay-a")
    store = b.store()
    got = await claim(store, policy=HEADS)
    assert got is not None and got.ids == [a1, a2, b1]
    await store.settle(got, [retry(20), retry(0), DONE])
    assert await claim(store, policy=HEADS) is None  # a2 is due, but a1 waits before it
    await b.advance(25)
    again = await claim(store, policy=HEADS)
    assert again is not None and again.ids == [a1, a2]
    assert [i.attempt for i in again.items] == [2, 2]


@pytest.mark.parametrize("block", [True, False])
async def test_ordered_a_dead_head_blocks_its_key_only_under_block(
    ordered_backend: Backend, block: bool
) -> None:
    b = ordered_backend
    a1, a2, b1 = [await b.put(n, key=key) for n, key in enumerate(["a", "a", "b"])]
    await b.hold_partitions("relay-a")
    store = b.store()
    policy = HeadsOnly(block=block)
    got = await claim(store, limit=1, policy=policy)
    assert got is not None and got.ids == [a1]
    await store.settle(got, [Decision(Verdict.DEAD, 0, "rejected")])
    expected = [b1] if block else [a2, b1]
    assert await claimed_ids(store, policy=policy) == expected


async def test_ordered_the_crash_loop_guard_holds_back_the_rest_of_the_key(
    ordered_backend: Backend,
) -> None:
    b = ordered_backend
    a1, a2, b1 = [await b.put(n, key=key) for n, key in enumerate(["a", "a", "b"])]
    await b.hold_partitions("relay-a", lease=600)
    store = b.store()
    for _ in range(MAX_ATTEMPTS):
        assert await claimed_ids(store, limit=1, policy=HEADS) == [a1]
        await b.advance(LEASE + 1)
    assert await claimed_ids(store, policy=HEADS) == [b1]  # a1 dead-lettered, a2 behind it
    row = await b.row(a1)
    assert row is not None and row.status == "failed"
    row = await b.row(a2)
    assert row is not None and (row.status, row.attempts) == ("pending", 0)


async def test_ordered_claims_keyed_items_only_in_partitions_it_holds(
    ordered_backend: Backend,
) -> None:
    b = ordered_backend
    keyed = await b.put(0, key="a")
    free = await b.put(1)
    store = b.store()
    assert await claimed_ids(store, owner="relay-a", policy=HEADS) == [free]
    await b.hold_partitions("relay-b")
    assert await claim(store, owner="relay-a", policy=HEADS) is None
    assert await claimed_ids(store, owner="relay-b", policy=HEADS) == [keyed]


async def test_ordered_a_claim_needs_the_partition_lease_for_longer_than_the_margin(
    ordered_backend: Backend,
) -> None:
    b = ordered_backend
    keyed = await b.put(0, key="a")
    await b.hold_partitions("relay-a", lease=10)
    store = b.store()
    assert await claim(store, policy=HeadsOnly(margin=20)) is None
    draining = HeadsOnly(draining=range(PARTITIONS))
    assert await claim(store, policy=draining) is None
    assert await claimed_ids(store, policy=HeadsOnly(margin=5)) == [keyed]


async def test_ordered_a_settle_after_the_partition_passed_on_changes_nothing(
    ordered_backend: Backend,
) -> None:
    b = ordered_backend
    keyed = await b.put(0, key="a")
    free = await b.put(1)
    await b.hold_partitions("relay-a", lease=10)
    store = b.store()
    got = await claim(store, policy=HEADS)
    assert got is not None and got.ids == [keyed, free]
    await b.advance(11)  # the partition lease ran out; the items' leases did not
    assert await b.hold_partitions("relay-b") != []
    assert await store.extend_leases(got, LEASE) == 1  # only the keyless item
    settled = await store.settle(got, [DONE, DONE])
    assert (list(settled.ids), settled.lost) == ([free], 1)
    row = await b.row(keyed)
    assert row is not None and (row.status, row.claim_token) == ("pending", got.token)


async def test_ordered_keyless_items_get_a_quarter_of_a_batch_full_of_keyed_ones(
    ordered_backend: Backend,
) -> None:
    b = ordered_backend
    keyed = [await b.put(n, key=f"k{n}") for n in range(6)]
    free = [await b.put(10 + n) for n in range(3)]
    await b.hold_partitions("relay-a")
    store = b.store()
    assert await claimed_ids(store, limit=4, policy=HEADS) == keyed[:4] + free[:1]
    assert await claimed_ids(store, limit=4, policy=HEADS) == keyed[4:] + free[1:]


async def test_ordered_concurrent_claimers_never_hold_one_key_at_once_and_go_in_order(
    ordered_backend: Backend,
) -> None:
    b = ordered_backend
    keys = [f"k{n % 5}" for n in range(60)]
    ids = [await b.put(n, key=key) for n, key in enumerate(keys)]
    key_of = dict(zip(ids, keys, strict=True))
    await b.hold_partitions("relay-a")
    stores = [b.store() for _ in range(4)]  # one relay's concurrent claims (max_in_flight)
    # key -> the claimer holding some of its items now, and whether its settle was sent: a
    # settle's commit can reach the database before its caller resumes, so another claim may
    # see the key free then (a claim while the holder has not settled yet is the violation).
    holder: dict[str, tuple[int, bool]] = {}
    order: dict[str, list[int]] = {}

    async def work(n: int, store: Store) -> None:
        idle = 0
        while idle < 3:
            got = await claim(store, limit=3, policy=HEADS)
            if got is None:
                idle += 1
                await asyncio.sleep(0.01)
                continue
            idle = 0
            mine = {key_of[i] for i in got.ids}
            for key in mine:
                other, settling = holder.get(key, (n, False))
                assert other == n or settling, f"{key} held by two claims at once"
                holder[key] = (n, False)
            for i in got.ids:
                order.setdefault(key_of[i], []).append(i)
            await asyncio.sleep(0.005)  # the publish
            for key in mine:
                holder[key] = (n, True)
            settled = await store.settle(got, [DONE] * len(got))
            assert settled.lost == 0
            for key in mine:
                if holder.get(key) == (n, True):
                    del holder[key]

    await asyncio.gather(*(work(n, s) for n, s in enumerate(stores)))
    assert {key: sorted(got) for key, got in order.items()} == order  # each key in id order
    assert sorted(i for got in order.values() for i in got) == ids  # each item once
