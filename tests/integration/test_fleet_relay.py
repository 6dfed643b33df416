"""``outboxkit relay --dsn-file``: one process relays every database of its file.

A real relay process over six databases of the session's PostgreSQL and one of a private
server that wants a password (given by a passfile, not the file), with writers committing
and rolling back in four of them, a seventh database added (SIGHUP) and one removed (found
by --reload-interval) while it runs, and two lines that never connect: a wrong password and
an unknown host, one log line each. NATS JetStream is the broker, and what it stored is
compared with what the databases committed: nothing lost, nothing rolled back published.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from outboxkit.backends.postgres.migrate import migrate
from outboxkit.ops.cli.app import main
from outboxkit.testing import EmbeddedPostgres, create_database, drop_database, free_port
from tests.support.relaying import (
    Writers,
    count,
    make_events,
    relay_connections,
    wait_for,
    write_events,
)
from tests.support.servers import consume_nats, ensure_stream, password_postgres, unique_name

PASSWORD = "fleet-secret-pw-1"
WRONG = "wrong-password-2"
#: The relay's connections to a database, by application_name (docs/fleet.md's formula).
RELAY_CONNECTIONS = (
    "outboxkit-relay:claim",
    "outboxkit-relay:settle",
    "outboxkit-relay:listen",
    "outboxkit-relay:metrics",
)


@pytest.fixture
def password_server() -> Iterator[EmbeddedPostgres]:
    """A private PostgreSQL where role fleet_pw logs in with a password (database fleet)."""
    with password_postgres("fleet_pw", PASSWORD, "fleet") as server:
        migrate(server.dsn_for("fleet"), table="outbox")
        yield server


@pytest.fixture
def databases(pg_server: Any, pg_template: str) -> Iterator[list[str]]:
    """Seven fresh migrated databases of the session's server (six listed at first)."""
    names = [unique_name("fleet") for _ in range(7)]
    for name in names:
        create_database(pg_server.dsn, name, template=pg_template)
    try:
        yield [pg_server.dsn_for(name) for name in names]
    finally:
        for name in names:
            drop_database(pg_server.dsn, name)


def _scrape(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _ids(messages: list[Any]) -> list[uuid.UUID]:
    return [uuid.UUID(m.headers["Nats-Msg-Id"]) for m in messages]


async def test_one_relay_process_serves_every_database_of_its_file(
    databases: list[str], password_server: EmbeddedPostgres, nats_server: Any, tmp_path: Path
) -> None:
    root = f"f{uuid.uuid4().hex[:8]}"
    stream = root.upper()
    await ensure_stream(nats_server.url, stream, [f"{root}.>"])
    port = password_server.port
    secured = f"postgresql://fleet_pw@127.0.0.1:{port}/fleet"  # (its password: the passfile)
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"127.0.0.1:{port}:fleet:fleet_pw:{PASSWORD}\n")
    passfile.chmod(0o600)
    listed = [f"db{i} {dsn}" for i, dsn in enumerate(databases[:6])]
    lines = [
        "# the fleet's databases",
        *listed,  # lines 2-7
        f"wrongpw postgresql://fleet_pw:{WRONG}@127.0.0.1:{port}/fleet",  # line 8
        "ghost postgresql://postgres@no-such-host.invalid:5432/shop",  # line 9
        "not a line!",  # line 10
        f"secured {secured}",  # line 11
    ]
    dsn_file = tmp_path / "databases.txt"
    dsn_file.write_text("\n".join(lines) + "\n")
    # (the test's own connections give the password; the relay's come from the passfile)
    secured_here = f"postgresql://fleet_pw:{PASSWORD}@127.0.0.1:{port}/fleet"
    serving = {f"db{i}": dsn for i, dsn in enumerate(databases[:6])} | {"secured": secured_here}
    backlog: dict[str, list[uuid.UUID]] = {}
    for name, dsn in serving.items():
        events = make_events(f"{root}.{name}", 40)
        write_events(dsn, events)
        backlog[dsn] = [e.event_id for e in events]

    # The naive way: the single-database relay given the wrong password's line exits
    # (a shell loop of relays, or one process relaying the lines in turn, stops there).
    naive = _run_single_relay(
        nats_server.url, f"postgresql://fleet_pw:{WRONG}@127.0.0.1:{port}/fleet"
    )
    assert naive.returncode == 2, naive.stderr
    assert "password authentication failed" in naive.stderr

    metrics_port = free_port()
    log_path = tmp_path / "fleet.log"
    cmd = [sys.executable, "-m", "outboxkit", "relay", "--dsn-file", str(dsn_file)]
    cmd += ["--broker", nats_server.url, "--reload-interval", "3", "--metrics-port"]
    cmd += [str(metrics_port), "--poll-interval", "0.2", "--lease", "10", "--log-level", "info"]
    env = {**os.environ, "PGPASSFILE": str(passfile)}
    env.pop("PGPASSWORD", None)
    writers = Writers()
    relay = _start(cmd, log_path, env)
    try:
        for name in ("db0", "db1", "db2", "secured"):
            writers.start(serving[name], f"{root}.{name}")
        for name, dsn in serving.items():
            await wait_for(
                lambda dsn=dsn: count(dsn, f"event_id IN ({_list(backlog[dsn])})") == 0,
                timeout=30,
                what=f"{name}'s backlog published",
            )

        # Connections: claim, LISTEN and the metrics' gauges, one each per database relayed,
        # and at most one settle connection (docs/fleet.md: a relay whose settles all rode on
        # its next claims, queue/carry.py, never opens one); none for the two that are down.
        # (sampled until steady: a connection a relay replaced, e.g. a settle hung up under
        # load, lingers in pg_stat_activity for a moment)
        per_database: dict[str, dict[str, int]] = {}

        def one_each(held: dict[str, int]) -> bool:
            settle = held.get("outboxkit-relay:settle", 0)
            others = {kind: n for kind, n in held.items() if kind != "outboxkit-relay:settle"}
            expected = dict.fromkeys(RELAY_CONNECTIONS[:1] + RELAY_CONNECTIONS[2:], 1)
            return settle <= 1 and others == expected

        def steady() -> bool:
            per_database.update({name: relay_connections(dsn) for name, dsn in serving.items()})
            return all(one_each(held) for held in per_database.values())

        try:
            await wait_for(steady, timeout=10, interval=0.2, what="one of each per database")
        except AssertionError:
            raise AssertionError(f"connections per database: {per_database}") from None
        total = sum(sum(held.values()) for held in per_database.values())
        assert 3 * len(serving) <= total <= len(RELAY_CONNECTIONS) * len(serving)
        print(f"fleet connections: {total} for {len(serving)} databases")

        # A database added to the file starts at SIGHUP.
        added = databases[6]
        write_events(added, make_events(f"{root}.db6", 30))
        dsn_file.write_text("\n".join([*lines, f"db6 {added}"]) + "\n")
        relay.send_signal(signal.SIGHUP)
        await wait_for(lambda: count(added, "status = 0") == 0, timeout=20, what="db6 relayed")
        text = log_path.read_text()
        assert text.index("SIGHUP: reading") < text.index("database db6 (line 12)"), text[-2000:]

        # Found by --reload-interval, no signal: a database removed from the file stops,
        # one whose DSN changed restarts on the new one.
        removed = serving.pop("db5")
        await wait_for(lambda: count(removed, "status = 0") == 0, what="db5 drained")
        changed = f"db4 {databases[4]}?connect_timeout=9"
        dsn_file.write_text("\n".join([*lines[:5], changed, *lines[7:], f"db6 {added}"]) + "\n")
        await wait_for(lambda: "database db5 left the file" in log_path.read_text(), timeout=10)
        assert "database db4 (line 6) changed: restarting its relay" in log_path.read_text()
        await wait_for(lambda: not relay_connections(removed), what="db5's connections closed")
        write_events(removed, make_events(f"{root}.db5", 10))  # no longer relayed
        after_change = make_events(f"{root}.db4", 10)
        write_events(serving["db4"], after_change)  # relayed by db4's new relay
        backlog[serving["db4"]] += [e.event_id for e in after_change]
        serving["db6"] = added

        status, body = _scrape(metrics_port, "/metrics")
        assert status == 200
        published_db0 = rf'outboxkit_events_published_total{{database="db0",topic="{root}.db0"}}'
        assert re.search(published_db0, body), body[-2000:]
        assert 'outboxkit_fleet_database_up{database="wrongpw"} 0.0' in body, body[-2000:]
        assert 'outboxkit_fleet_database_up{database="db6"} 1.0' in body
        assert 'database="db5"' not in body, "a removed database's series leave with it"
        status, body = _scrape(metrics_port, "/readyz")
        assert status == 503 and "ghost" in body and "wrongpw" in body, body

        await asyncio.sleep(1.0)
        writers.join()
        for name, dsn in serving.items():
            await wait_for(
                lambda dsn=dsn: count(dsn, "status = 0") == 0, timeout=30, what=f"{name} drained"
            )
    finally:
        writers.join()
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(30)
    text = log_path.read_text()
    assert code == 0, text[-3000:]

    # The two databases that never connect: one line each, naming their line and name.
    assert len(re.findall(r"database wrongpw \(line 8\) is not relayed", text)) == 1, text
    assert len(re.findall(r"database ghost \(line 9\) is not relayed", text)) == 1, text
    assert "password authentication failed" in text
    # a bad line: reported once, not at every reload (again when it moved to line 9)
    assert len(re.findall(r"line 10: 'not' is followed by no DSN", text)) == 1, text
    assert WRONG not in text and PASSWORD not in text
    assert count(removed, "status = 0") == 10, "db5's later events stayed in its table"

    messages = await consume_nats(nats_server.url, stream, f"{root}.>", None, timeout=20)
    published = _ids(messages)
    committed = {i for ids in writers.committed.values() for i in ids}
    committed |= {i for ids in backlog.values() for i in ids}
    with psycopg.connect(added) as conn:
        rows = conn.execute("SELECT count(*) FROM outbox").fetchone()
    assert rows == (0,)
    lost = committed - set(published)
    phantom = set(writers.rolled_back) & set(published)
    assert not lost, f"{len(lost)} committed events never reached the broker"
    assert not phantom, f"{len(phantom)} rolled-back events were published"
    assert len(published) == len(set(published))
    assert len(committed) >= 7 * 40 + 4 * 20, len(committed)


def _run_single_relay(broker: str, dsn: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "outboxkit", "relay", "--broker", broker, "--dsn", dsn]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def _start(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def _list(ids: list[uuid.UUID]) -> str:
    return ",".join(f"'{i}'" for i in ids)


def test_status_lists_each_database_and_shows_the_unreachable_ones(
    databases: list[str], tmp_path: Path
) -> None:
    write_events(databases[0], make_events("orders", 3))
    dsn_file = tmp_path / "databases.txt"
    dsn_file.write_text(
        f"shop {databases[0]}\n{databases[1]}\n"
        "ghost postgresql://postgres@no-such-host.invalid:5432/shop\n"
        "bad!\n"
    )
    result = CliRunner().invoke(main, ["status", "--dsn-file", str(dsn_file), "--json"])
    assert result.exit_code == 1, result.output
    import json

    shown = json.loads(result.output)
    by_name = {d["name"]: d for d in shown["databases"]}
    assert by_name["shop"]["pending"] == 3 and by_name["shop"]["error"] is None
    assert by_name["shop"]["oldest_pending_age_s"] is not None
    second = by_name[next(n for n in by_name if n not in ("shop", "ghost"))]
    assert second["pending"] == 0 and second["line"] == 2
    assert by_name["ghost"]["pending"] is None
    assert "no-such-host.invalid" in by_name["ghost"]["error"]
    assert shown["bad_lines"][0]["line"] == 4

    table = CliRunner().invoke(main, ["status", "--dsn-file", str(dsn_file)])
    assert table.exit_code == 1
    assert "shop" in table.output and "unreachable" in table.output, table.output
    both = CliRunner().invoke(main, ["status", "--dsn-file", str(dsn_file), "--dsn", databases[0]])
    assert both.exit_code == 2 and "give one" in both.output

    # A file with nothing listed says so (it printed nothing at all).
    empty = tmp_path / "empty.txt"
    empty.write_text("# no database yet\n")
    nothing = CliRunner().invoke(main, ["status", "--dsn-file", str(empty)])
    assert nothing.exit_code == 0 and "lists none" in nothing.output, nothing.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--dsn", "postgresql://db/x", "--dsn-file", "f"], "give one of them"),
        ([], "give --dsn (or OUTBOXKIT_DSN), or --dsn-file"),
        (["--dsn-file", "f", "--direct-dsn", "postgresql://db/x"], "--direct-dsn serves one"),
        (["--dsn-file", "f", "--source", "cdc"], "--source cdc serves one"),
        (["--dsn-file", "f", "--dashboard", "--metrics-port", "0"], "--dashboard serves one"),
        (["--dsn-file", "missing.txt"], "cannot read the DSN file 'missing.txt'"),
    ],
)
def test_relay_takes_one_database_or_a_file_of_them(
    args: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUTBOXKIT_DSN", raising=False)
    (tmp_path / "f").write_text("")
    result = CliRunner().invoke(main, ["relay", "--broker", "nats://127.0.0.1:1", *args])
    assert result.exit_code == 2, result.output
    assert said in result.output, result.output
