"""The share each fleet process aims at, and the order in which it takes free databases."""

from __future__ import annotations

from outboxkit.fleet.leases import member_id, rank, target


def test_each_process_aims_at_ceil_of_databases_over_processes() -> None:
    assert target(12, {"a", "b"}) == 6
    assert target(13, {"a", "b"}) == 7  # (2 x 7 >= 13: every database has room)
    assert target(12, {"a", "b", "c", "d", "e"}) == 3
    assert target(0, {"a"}) == 0
    assert target(5, set()) == 5  # (none seen yet: this process alone)


def test_processes_prefer_different_databases() -> None:
    names = [f"db{i}" for i in range(40)]
    first = sorted(names, key=lambda n: rank("host:1:aa", n))
    second = sorted(names, key=lambda n: rank("host:2:bb", n))
    assert first != second
    assert first == sorted(names, key=lambda n: rank("host:1:aa", n))  # (stable)
    assert len(set(first[:10]) & set(second[:10])) < 10


def test_member_ids_are_unique_per_process_start() -> None:
    assert member_id() != member_id()
    assert member_id().count(":") == 2
