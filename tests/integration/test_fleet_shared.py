"""Several ``outboxkit relay --dsn-file`` processes given one file divide its databases.

Real relay processes over databases of two private PostgreSQL servers (a twelfth of them on
the second; ``make chaos-fleet`` lists one MariaDB database too, relayed by the same
processes), writers committing and rolling back in a few of them and in every database off
the first server, NATS JetStream as the broker (its Nats-Msg-Id dedup is the broker dedup).
Two processes share the file; one is SIGKILLed and a third joins; a database is added to the
file and one removed. After each change every database is owned by exactly one live process
(read from the lease table in each database), the processes hold an even share, and only
the owner holds a claim connection to it (PostgreSQL's, told apart by name). At the end what
the broker stored is compared with what the databases committed: nothing lost, nothing
rolled back published.

``OUTBOXKIT_FLEET_CHAOS_DATABASES`` and ``OUTBOXKIT_FLEET_CHAOS_KILLS`` make it bigger
(``make chaos-fleet``: 60 databases, two SIGKILLs).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from outboxkit.backends.postgres.migrate import migrate
from outboxkit.ops.cli.app import main
from outboxkit.testing import EmbeddedPostgres, create_database, drop_database
from tests.support.fleet import FleetProcesses, balanced, owner, owner_pid, pending
from tests.support.mariadb_ops import new_database
from tests.support.relaying import (
    Writers,
    count,
    make_events,
    relay_connections,
    wait_for,
    write_events,
)
from tests.support.servers import consume_nats, ensure_stream, unique_name

DATABASES = int(os.environ.get("OUTBOXKIT_FLEET_CHAOS_DATABASES", "12"))
KILLS = int(os.environ.get("OUTBOXKIT_FLEET_CHAOS_KILLS", "1"))
#: Listed databases on a second PostgreSQL server (a fleet's file names several servers).
SECOND_SERVER = max(1, DATABASES // 12)
#: `make chaos-fleet` lists a MariaDB database too: one process relays both kinds.
WITH_MARIADB = DATABASES > 12
# (a takeover is judged by the clock; `make chaos-fleet`'s 60 databases take minutes)
pytestmark = [pytest.mark.exclusive, pytest.mark.timeout(150 + 6 * DATABASES)]
#: The fleet lease of the processes (a round every third of it).
LEASE = 5.0 if DATABASES <= 12 else 8.0
#: The relays' poll (writes wake them by NOTIFY; 60 relays a process polling every 0.2 s
#: would be most of the load of `make chaos-fleet`).
POLL = "0.2" if DATABASES <= 12 else "1"
#: How long the processes may take to settle after a change (a process takes 16 free
#: databases a round at most).
SETTLE = 4 * LEASE + DATABASES / 2


def _server(max_connections: int, names: list[str]) -> EmbeddedPostgres:
    """A private PostgreSQL holding migrated databases ``names``: a relay holds connections
    to each, more than the shared server allows."""
    server = EmbeddedPostgres(fsync=False, settings={"max_connections": str(max_connections)})
    server.start()
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("CREATE DATABASE template_outbox")
    migrate(server.dsn_for("template_outbox"), table="outbox")
    for name in names:
        create_database(server.dsn, name, template="template_outbox")
    return server


@pytest.fixture
def databases(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """DATABASES + 1 migrated databases (the last one is added to the file later): the most
    on one private server, SECOND_SERVER of them on a second one, and (WITH_MARIADB) one on
    the private MariaDB."""
    names = [f"db{i}" for i in range(DATABASES + 1)]
    # every so often a database of the other server (never the one added later)
    second = set(
        names[DATABASES // SECOND_SERVER // 2 :: DATABASES // SECOND_SERVER][:SECOND_SERVER]
    )
    maria = names[DATABASES // 2 + 1] if WITH_MARIADB and _mariadb(request) else None
    first = [n for n in names if n not in second and n != maria]
    servers = []
    try:
        servers.append(_server(8 * DATABASES + 50, first))
        servers.append(_server(8 * SECOND_SERVER + 50, sorted(second)))
        urls = {n: servers[0].dsn_for(n) for n in first}
        urls.update({n: servers[1].dsn_for(n) for n in second})
        if maria is not None:
            urls[maria] = new_database(request.getfixturevalue("mariadb_server"))
        yield [urls[n] for n in names]
    finally:
        for server in servers:
            server.close()


def _mariadb(request: pytest.FixtureRequest) -> bool:
    """Whether the private MariaDB runs here (without mariadbd, all databases are
    PostgreSQL's rather than the whole run skipped)."""
    try:
        request.getfixturevalue("mariadb_server")
    except pytest.skip.Exception as exc:
        print(f"no MariaDB database in the file: {exc}")
        return False
    return True


def _server_of(dsn: str) -> str:
    return urllib.parse.urlsplit(dsn).netloc


def _popen(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


async def test_fleet_processes_divide_the_databases_and_take_over_a_killed_ones(
    databases: list[str], nats_server: Any, tmp_path: Path
) -> None:
    root = f"s{uuid.uuid4().hex[:8]}"
    stream = root.upper()
    await ensure_stream(nats_server.url, stream, [f"{root}.>"])
    names = {dsn: f"db{i}" for i, dsn in enumerate(databases)}
    listed = databases[:DATABASES]
    dsn_file = tmp_path / "databases.txt"
    dsn_file.write_text("".join(f"{names[dsn]} {dsn}\n" for dsn in listed))
    fleet = FleetProcesses(dsn_file, nats_server.url, tmp_path, LEASE, POLL)
    writers = Writers()
    taken_over: list[float] = []
    try:
        first = fleet.start()
        fleet.start()
        await balanced(fleet, listed, SETTLE, "two processes, an even share each")
        # `status --dsn-file` names each database's owner
        shown = CliRunner().invoke(main, ["status", "--dsn-file", str(dsn_file), "--json"])
        shown_owners = {d["name"]: d["owner"] for d in json.loads(shown.output)["databases"]}
        owners = {name: int(member.split(":")[-2]) for name, member in shown_owners.items()}
        assert owners == {names[dsn]: owner_pid(dsn) for dsn in listed}, shown.output
        assert set(owners.values()) == set(fleet.live)
        # writers where the process about to be killed relays, and elsewhere
        kept = listed[:-1]  # (the last one leaves the file later)
        doomed = [dsn for dsn in kept if owner_pid(dsn) == first.pid]
        others = [dsn for dsn in kept if dsn not in doomed]
        # and in every database off the first server (the second PostgreSQL, MariaDB)
        elsewhere = [dsn for dsn in kept if _server_of(dsn) != _server_of(listed[0])]
        for dsn in dict.fromkeys(doomed[:2] + others[:2] + elsewhere):
            writers.start(dsn, f"{root}.{names[dsn]}")
        await wait_for(lambda: len(writers.committed[doomed[0]]) > 50, timeout=10)

        victim = first
        for _ in range(KILLS):
            fleet.kill(victim)  # its databases: taken over once its lease runs out
            owned = balanced(fleet, listed, SETTLE, "owned after a SIGKILL", claims=False)
            taken_over.append(await owned)
            await balanced(fleet, listed, SETTLE, "relayed after a SIGKILL")
            victim = fleet.start()  # a process joins: the databases spread again
            await balanced(fleet, listed, SETTLE, "after a process joined")

        # a database added to the file, one removed: SIGHUP to every process
        added, removed = databases[DATABASES], listed[-1]
        listed = [*listed[:-1], added]
        dsn_file.write_text("".join(f"{names[dsn]} {dsn}\n" for dsn in listed))
        fleet.hup()
        await balanced(fleet, listed, SETTLE, "after a database was added and one removed")
        await wait_for(lambda: not relay_connections(removed), what="the removed one let go")
        # (handed back at once; a check under way as the file changed may take it once
        # more, and then its lease runs out unrenewed)
        await wait_for(lambda: owner(removed) is None, timeout=LEASE + 2, what="no owner")
        writers.start(added, f"{root}.{names[added]}")
        await wait_for(lambda: len(writers.committed[added]) > 20, timeout=10)

        writers.join()
        for dsn in listed:
            await wait_for(lambda dsn=dsn: pending(dsn) == 0, timeout=30, what=f"{dsn} drained")
    finally:
        writers.join()
        codes = fleet.stop()
    assert codes == [0] * len(codes), fleet.log_tail()
    # a graceful stop hands its databases back at once (no lease left to run out)
    assert all(owner(dsn) is None for dsn in listed)
    print(f"fleet: {DATABASES} databases, takeovers after SIGKILL in {taken_over} s")

    messages = await consume_nats(nats_server.url, stream, f"{root}.>", None, timeout=20)
    published = [uuid.UUID(m.headers["Nats-Msg-Id"]) for m in messages]
    committed = {i for ids in writers.committed.values() for i in ids}
    lost = committed - set(published)
    phantom = set(writers.rolled_back) & set(published)
    assert not lost, f"{len(lost)} committed events never reached the broker"
    assert not phantom, f"{len(phantom)} rolled-back events were published"
    assert len(published) == len(set(published)), "published twice past the broker's dedup"
    assert len(committed) > 200, len(committed)
    # within a lease and a round, a round more per 16 databases of the dead one's share, and
    # a round of slack (rounds run late on a loaded machine)
    rounds = math.ceil(math.ceil(DATABASES / 2) / 16) + 1
    assert all(t <= LEASE + rounds * LEASE / 3 + 2.0 for t in taken_over), taken_over


async def test_an_idle_database_holds_no_settle_connection(
    pg_server: Any, pg_template: str, nats_server: Any, tmp_path: Path
) -> None:
    """docs/fleet.md's count: a database with nothing to publish holds its claim and LISTEN
    connections only; the settle connection its last batch opened closes once idle
    (OUTBOXKIT_SETTLE_IDLE, 30 s by default; 1 s here)."""
    names = [unique_name("fleetidle") for _ in range(3)]
    for name in names:
        create_database(pg_server.dsn, name, template=pg_template)
    dsns = [pg_server.dsn_for(name) for name in names]
    root = f"i{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    dsn_file = tmp_path / "databases.txt"
    dsn_file.write_text("".join(f"db{i} {dsn}\n" for i, dsn in enumerate(dsns)))
    cmd = [sys.executable, "-m", "outboxkit", "relay", "--dsn-file", str(dsn_file)]
    # One batch in flight: no claim can carry a settle (queue/carry.py needs a free slot
    # beside the offering batch's), so each settle opens the settle connection, the subject.
    cmd += ["--broker", nats_server.url, "--poll-interval", "0.2", "--max-in-flight", "1"]
    env = {**os.environ, "OUTBOXKIT_SETTLE_IDLE": "1"}
    process = _popen(cmd, tmp_path / "relay.log", env)
    try:
        write_events(dsns[0], make_events(f"{root}.db0", 20))
        await wait_for(lambda: count(dsns[0], "status = 0") == 0, timeout=20, what="published")
        busy = relay_connections(dsns[0])
        # (the batch's settle connection, open at the publish; gone a second later)
        idle_after = {"outboxkit-relay:claim": 1, "outboxkit-relay:listen": 1}
        await wait_for(lambda: relay_connections(dsns[0]) == idle_after, timeout=10)
        held = {dsn: relay_connections(dsn) for dsn in dsns}
        assert all(h == idle_after for h in held.values()), held
        print(f"idle fleet: {sum(sum(h.values()) for h in held.values())} connections for 3")
        assert busy.get("outboxkit-relay:settle") == 1, busy
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        for name in names:
            drop_database(pg_server.dsn, name)
