"""The fleet lease contract: what fleet/leases.py relies on from each database's lease
(``Backend.fleet_lease``), on PostgreSQL and MariaDB alike. One owner at a time; the owner
keeps the database while it checks, and loses it once its lease runs out by the database's
clock (its late check then finds another owner: it stops serving); a check on one database
never waits for a check on another of the same server."""

from __future__ import annotations

import asyncio

from tests.contract.fleet_databases import PostgresLeaseDatabase

LeaseDatabase = PostgresLeaseDatabase


async def test_the_first_check_makes_the_table_and_one_process_owns_the_database(
    lease_database: LeaseDatabase,
) -> None:
    a, b = lease_database.lease("a"), lease_database.lease("b")
    seen = await a.check(want=True)  # (no table yet: the check makes it)
    assert seen.owner == "a" and seen.members == {"a"}
    seen = await b.check(want=True)
    assert seen.owner == "a" and seen.members == {"a", "b"}
    assert (await a.check(want=True)).owner == "a"  # kept while it checks
    assert lease_database.owners() == ["a"]


async def test_a_database_handed_back_is_taken_by_another(lease_database: LeaseDatabase) -> None:
    a, b = lease_database.lease("a"), lease_database.lease("b")
    await a.check(want=True)
    assert (await a.check(want=False)).owner is None
    assert (await b.check(want=True)).owner == "b"
    assert (await a.check(want=True)).owner == "b"  # (a wanting it back waits its turn)


async def test_a_lease_runs_out_by_the_databases_clock_and_the_late_owner_is_fenced_out(
    lease_database: LeaseDatabase,
) -> None:
    a, b = lease_database.lease("a", ttl=30.0), lease_database.lease("b", ttl=30.0)
    await a.check(want=True)
    await b.check(want=True)
    lease_database.age(20)  # within the lease: a still owns it
    assert (await b.check(want=True)).owner == "a"
    lease_database.age(15)  # a (not renewed for 35 s) is gone; b renewed 15 s ago is not
    seen = await b.check(want=True)
    assert seen.owner == "b" and seen.members == {"b"}
    # a's check comes late (a pause): it finds b owning the database, not its old lease
    seen = await a.check(want=True)
    assert seen.owner == "b" and seen.members == {"a", "b"}
    assert lease_database.owners() == ["b"]


async def test_processes_checking_at_once_leave_one_owner(lease_database: LeaseDatabase) -> None:
    """Even as their first checks, which all find no table and make it at once (on
    PostgreSQL two CREATE TABLE IF NOT EXISTS at once can collide in the catalog)."""
    leases = [lease_database.lease(f"m{i}") for i in range(8)]
    seen = await asyncio.gather(*(lease.check(want=True) for lease in leases))
    owners = {s.owner for s in seen}
    assert len(owners) == 1 and owners != {None}, owners
    assert lease_database.owners() == sorted(owners)  # type: ignore[type-var]


async def test_leave_forgets_the_process_and_frees_its_database(
    lease_database: LeaseDatabase,
) -> None:
    a, b = lease_database.lease("a"), lease_database.lease("b")
    await a.leave()  # (no table yet: nothing to forget, no error)
    await a.check(want=True)
    await b.check(want=False)
    await a.leave()
    seen = await b.check(want=True)
    assert seen.owner == "b" and seen.members == {"b"}


async def test_services_are_leased_apart(lease_database: LeaseDatabase) -> None:
    relay = lease_database.lease("a", service="relay:outbox")
    worker = lease_database.lease("b", service="worker:outboxkit_tasks")
    assert (await relay.check(want=True)).owner == "a"
    assert (await worker.check(want=True)).owner == "b"
    assert lease_database.owners("worker:outboxkit_tasks") == ["b"]


async def test_a_check_does_not_wait_for_one_under_way_on_another_database(
    lease_database: LeaseDatabase,
) -> None:
    """The check lock is per database: MariaDB's GET_LOCK names are the server's, so a name
    without the database's would make every database of a server wait on one check (here
    for 10 s, a third of the lease, and then fail)."""
    other = lease_database.sibling()
    try:
        with lease_database.check_under_way():
            seen = await asyncio.wait_for(other.lease("a").check(want=True), timeout=5)
        assert seen.owner == "a"
    finally:
        other.close()
