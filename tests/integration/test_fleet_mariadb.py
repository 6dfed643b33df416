"""Two ``outboxkit relay --dsn-file`` processes divide six MariaDB databases through the lease
table in each (backends/mariadb/fleet_leases.py), as on PostgreSQL (test_fleet_shared.py).

Real relay processes, the private mariadbd, writers committing and rolling back in three of
the databases, NATS JetStream as the broker (its Nats-Msg-Id dedup is the broker dedup). One
process is SIGKILLed: its databases are owned by the other within the lease and a round.
Every database has exactly one live owner throughout (read from its ``outboxkit_fleet``);
from NATS's side no committed event is lost and no rolled-back one published.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outboxkit.backends import backend_for
from tests.support.fleet import FleetProcesses, balanced, owner_pid, pending
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import mariadb_execute, new_database
from tests.support.relaying import Writers, wait_for
from tests.support.servers import consume_nats, ensure_stream

pytestmark = [pytest.mark.exclusive, pytest.mark.timeout(120)]

DATABASES = 6
#: The fleet lease (a round every 1.3 s at most; a check answers within a third of it: with
#: 2.4 s, a loaded machine's late rounds let leases lapse between two checks).
LEASE = 4.0


@pytest.fixture
def databases(mariadb_server: MariaDB) -> Iterator[list[str]]:
    """DATABASES migrated outboxes and lease tables on the private MariaDB."""
    urls = [new_database(mariadb_server) for _ in range(DATABASES)]
    for url in urls:  # (as docs/fleet.md advises: the first checks need not make it)
        backend_for(url).migrate_fleet(url)
    try:
        yield urls
    finally:
        for url in urls:
            mariadb_execute(url, f"DROP DATABASE {url.rsplit('/', 1)[1]}")


async def test_two_fleet_processes_divide_mariadb_databases_and_take_over_a_killed_ones(
    databases: list[str], nats_server: Any, tmp_path: Path
) -> None:
    root = f"m{uuid.uuid4().hex[:8]}"
    stream = root.upper()
    await ensure_stream(nats_server.url, stream, [f"{root}.>"])
    dsn_file = tmp_path / "databases.txt"
    dsn_file.write_text("".join(f"m{i} {dsn}\n" for i, dsn in enumerate(databases)))
    fleet = FleetProcesses(dsn_file, nats_server.url, tmp_path, LEASE, "0.2")
    writers = Writers()
    try:
        first = fleet.start()
        fleet.start()
        await balanced(fleet, databases, 4 * LEASE, "two processes, three databases each")
        doomed = [dsn for dsn in databases if owner_pid(dsn) == first.pid]
        kept = [dsn for dsn in databases if dsn not in doomed]
        for dsn in [*doomed[:2], kept[0]]:
            writers.start(dsn, f"{root}.{databases.index(dsn)}")
        await wait_for(lambda: len(writers.committed[doomed[0]]) > 30, timeout=10)

        fleet.kill(first)  # its databases: taken over once its lease runs out
        took = await balanced(fleet, databases, 4 * LEASE, "owned after a SIGKILL")
        print(f"mariadb fleet: {len(doomed)} databases taken over {took:.1f} s after a SIGKILL")
        await wait_for(lambda: len(writers.committed[doomed[0]]) > 80, timeout=10)
        writers.join()
        for dsn in databases:  # (the killed batch is claimed again once its lease runs out)
            await wait_for(lambda dsn=dsn: pending(dsn) == 0, timeout=20, what="drained")
    finally:
        writers.join()
        codes = fleet.stop()
    assert codes == [0] * len(codes), fleet.log_tail()
    # within a lease and a round (7.2 s at most measured under a load average of 14 on
    # 2 cores), and slack: rounds run late on a loaded machine
    assert took <= 2 * LEASE + 2.0, took

    messages = await consume_nats(nats_server.url, stream, f"{root}.>", None, timeout=20)
    published = [uuid.UUID(m.headers["Nats-Msg-Id"]) for m in messages]
    committed = {i for ids in writers.committed.values() for i in ids}
    assert not committed - set(published), "committed events never reached the broker"
    assert not set(writers.rolled_back) & set(published), "rolled-back events were published"
    assert len(published) == len(set(published)), "published twice past the broker's dedup"
    assert len(committed) > 150, len(committed)
