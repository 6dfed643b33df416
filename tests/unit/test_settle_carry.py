"""queue/carry.py: a parked settle rides on the next claim, or runs on its own; never lost.

Pure units (a store stand-in): the statement itself is tests/integration/
test_claim_carries_settle.py's.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from outboxkit.queue.carry import SettleCarry
from outboxkit.queue.store import Claim, Settled, StoreUnavailable


class _Store:
    carries_settles = True

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.carried: list[Claim[Any]] = []

    async def claim_settling(self, carried: Claim[Any], **_: Any) -> tuple[None, Settled]:
        if self.fail:
            raise StoreUnavailable("gone", cause=OSError("gone"))
        self.carried.append(carried)
        return None, Settled(carried.ids)


def _claim() -> Claim[Any]:
    return Claim(uuid.uuid4(), [1, 2], [object(), object()])


async def _plain() -> None:
    return None


ARGS: dict[str, Any] = {
    "limit": 10, "lease": 30.0, "token": uuid.uuid4(), "owner": "t", "max_attempts": 5,
}  # fmt: skip


async def test_a_settle_offered_while_a_claim_is_coming_rides_on_it() -> None:
    store = _Store()
    carry: SettleCarry[Any] = SettleCarry(store, lambda: True)
    done = _claim()
    assert carry.offer(done) is None  # not open: no claim is coming, settle now
    carry.open()
    parked = carry.offer(done)
    assert parked is not None
    assert carry.offer(_claim()) is None  # one at a time
    assert await carry.claim(_plain, **ARGS) is None
    assert store.carried == [done] and parked.result() == Settled(done.ids)
    assert carry.offer(_claim()) is None  # the claim closed it


async def test_without_a_free_slot_for_the_claim_the_settle_runs_on_its_own() -> None:
    carry: SettleCarry[Any] = SettleCarry(_Store(), lambda: False)
    carry.open()
    assert carry.offer(_claim()) is None


async def test_a_failed_claim_or_no_claim_at_all_hands_the_settle_back() -> None:
    store = _Store(fail=True)
    carry: SettleCarry[Any] = SettleCarry(store, lambda: True)
    carry.open()
    parked = carry.offer(_claim())
    assert parked is not None
    with pytest.raises(StoreUnavailable):
        await carry.claim(_plain, **ARGS)
    assert parked.result() is None  # the statement settled nothing: settle alone
    carry.open()
    parked = carry.offer(_claim())
    assert parked is not None
    carry.flush()  # the loop stops, or goes to its poll wait
    assert parked.result() is None
