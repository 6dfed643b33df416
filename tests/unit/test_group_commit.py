"""Settles arriving while a group is written go together in the next group."""

from __future__ import annotations

import asyncio

import pytest

from outboxkit.queue.group_commit import GroupCommit
from outboxkit.queue.store import StoreTimeout


async def test_settles_arriving_during_a_write_share_the_next_one() -> None:
    groups: list[list[int]] = []

    async def write(items: list[int]) -> set[int]:
        groups.append(items)
        await asyncio.sleep(0.01)
        return {i for i in items if i != 3}  # 3 was re-claimed elsewhere

    grouped = GroupCommit(write)
    got = await asyncio.gather(*(grouped.add(i) for i in range(1, 6)))
    assert groups == [[1], [2, 3, 4, 5]]  # one write, then one for all that waited
    assert 3 not in got[2] and 5 in got[4]


async def test_a_failed_write_fails_its_group_only() -> None:
    calls = 0

    async def write(items: list[int]) -> set[int]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        if calls == 1:
            raise StoreTimeout("deadlock")
        return set(items)

    grouped = GroupCommit(write)
    first = asyncio.ensure_future(grouped.add(1))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(grouped.add(2))
    with pytest.raises(StoreTimeout):
        await first
    assert await second == {2}
