"""The outage hand-back on its own (queue/handback.py): its pace, what it remembers, and
what it makes due once the target is back, on the in-memory store."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from outboxkit.queue.decide import RetryPolicy
from outboxkit.queue.handback import MAX_HANDED_BACK, HandBack
from outboxkit.queue.memory import MemoryQueue, MemoryQueueStore
from outboxkit.queue.store import Decision, Verdict


@dataclass
class _Item:
    value: str
    attempt: int


class _Target:
    name = "memory"

    def __init__(self) -> None:
        self.back_at: float | None = None

    def restored_since(self, when: float) -> bool:
        return self.back_at is not None and self.back_at > when


def _hand_back() -> tuple[HandBack, MemoryQueue[str], _Target, list[int]]:
    queue: MemoryQueue[str] = MemoryQueue()
    store = MemoryQueueStore(queue, _Item)
    target, woken = _Target(), []
    hand_back = HandBack(
        store,
        target,
        RetryPolicy(max_attempts=5, base=1.0, cap=8.0),
        logging.getLogger("test"),
        lambda: woken.append(1),
    )
    return hand_back, queue, target, woken


def test_the_pace_grows_while_the_target_is_down_and_starts_over_once_it_is_up() -> None:
    hand_back, *_ = _hand_back()
    assert hand_back.delay(None) == 0.0  # not an outage: the items' own decision
    downs = [hand_back.delay(True) for _ in range(6)]
    assert all(0 <= d <= 8.0 for d in downs) and max(downs) > 0
    assert hand_back.delay(False) == 0.0
    hand_back.remember([1, 2], 0.0)  # no outage delay: nothing to make due later
    assert not hand_back.waiting


async def test_what_was_handed_back_is_made_due_once_the_target_is_back() -> None:
    hand_back, queue, target, woken = _hand_back()
    store = MemoryQueueStore(queue, _Item)
    ids = [queue.put(v) for v in ("a", "b")]
    claim = await store.claim(
        limit=2, lease=30.0, token=uuid.uuid4(), owner="t", max_attempts=5, policy=None
    )
    assert claim is not None
    outage = Decision(Verdict.HAND_BACK, delay=60.0)
    await store.settle(claim, [outage, outage])
    assert (
        await store.claim(
            limit=2, lease=30.0, token=uuid.uuid4(), owner="t", max_attempts=5, policy=None
        )
        is None
    )  # handed back for a minute
    hand_back.remember(ids, 60.0)
    assert hand_back.waiting and not hand_back.target_restored()
    target.back_at = time.monotonic() + 1
    assert hand_back.target_restored()
    await hand_back.target_back()
    assert not hand_back.waiting and woken == [1]
    again = await store.claim(
        limit=2, lease=30.0, token=uuid.uuid4(), owner="t", max_attempts=5, policy=None
    )
    assert again is not None and sorted(again.ids) == sorted(ids)


def test_it_remembers_at_most_its_bound() -> None:
    hand_back, *_ = _hand_back()
    hand_back.remember(list(range(MAX_HANDED_BACK)), 1.0)
    hand_back.remember([MAX_HANDED_BACK + 1], 1.0)
    assert len(hand_back._ids) == MAX_HANDED_BACK
