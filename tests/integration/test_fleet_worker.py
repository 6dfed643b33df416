"""``outboxkit worker --dsn-file``: one worker process works on every database of its file.

The same supervisor as ``relay --dsn-file`` (outboxkit.fleet): each database's tasks run in
that database (their effect commits there, fenced), a database added at SIGHUP gets a
worker, one with an unknown host is one log line and holds back no other.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from outboxkit.backends.postgres.migrate import migrate, migrate_tasks
from outboxkit.testing import create_database, drop_database, free_port
from tests.support.relaying import wait_for
from tests.support.servers import password_postgres, unique_name
from tests.support.tasks_app import tasks

ROOT = Path(__file__).resolve().parents[2]
TASKS_EACH = 20


@pytest.fixture
def task_databases(pg_server: Any) -> Iterator[list[str]]:
    """Three fresh databases with the task table and an effects table."""
    names = [unique_name("fleetw") for _ in range(3)]
    dsns = []
    for name in names:
        create_database(pg_server.dsn, name)
        dsn = pg_server.dsn_for(name)
        migrate_tasks(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE effects (task_id bigint, attempt int)")
        dsns.append(dsn)
    try:
        yield dsns
    finally:
        for name in names:
            drop_database(pg_server.dsn, name)


def _enqueue(dsn: str) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for _ in range(TASKS_EACH):
            tasks.enqueue(conn, "effect", {"ms": 1})


def _effects(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(DISTINCT task_id) FROM effects").fetchone()
    return int(row[0]) if row else 0


def _spawn(dsn_file: Path, log_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("OUTBOXKIT_DSN", None)
    command = [sys.executable, "-m", "outboxkit", "worker", "--dsn-file", str(dsn_file)]
    command += ["--app", "tests.support.tasks_app:tasks", "--poll-interval", "0.1"]
    command += ["--reload-interval", "3600", *extra]
    with log_path.open("ab") as out:
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


async def test_one_worker_process_works_on_every_database_of_its_file(
    task_databases: list[str], tmp_path: Path
) -> None:
    first, second, added = task_databases
    for dsn in task_databases:
        _enqueue(dsn)
    lines = [f"w0 {first}", f"w1 {second}", "ghost postgresql://postgres@no-such-host.invalid/x"]
    dsn_file = tmp_path / "databases.txt"
    dsn_file.write_text("\n".join(lines) + "\n")
    log_path = tmp_path / "worker.log"
    worker = _spawn(dsn_file, log_path)
    try:
        for dsn in (first, second):
            await wait_for(lambda dsn=dsn: _effects(dsn) == TASKS_EACH, timeout=30)
        assert _effects(added) == 0, "a database not in the file is not worked on"

        dsn_file.write_text("\n".join([*lines, f"w2 {added}"]) + "\n")
        worker.send_signal(signal.SIGHUP)
        await wait_for(lambda: _effects(added) == TASKS_EACH, timeout=30, what="w2's tasks")
        await asyncio.sleep(0.5)
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(30)
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert len(re.findall(r"database ghost \(line 3\) is not served", text)) == 1, text
    assert "[w2] worker" in text, "a worker's own lines name its database"
    for dsn in task_databases:
        with psycopg.connect(dsn, autocommit=True) as conn:
            left = conn.execute("SELECT count(*) FROM outboxkit_tasks").fetchone()
            twice = conn.execute(
                "SELECT count(*) FROM (SELECT task_id FROM effects GROUP BY 1"
                " HAVING count(*) > 1) t"
            ).fetchone()
        assert left == (0,) and twice == (0,)


OWNER = (
    "SELECT member FROM outboxkit_fleet"
    " WHERE service = 'worker:outboxkit_tasks' AND owner AND expires_at > now()"
)


def _owner_pid(dsn: str) -> int | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            row = conn.execute(OWNER).fetchone()
        except psycopg.errors.UndefinedTable:
            return None
    return int(str(row[0]).split(":")[-2]) if row else None


def _connected_pids(dsn: str, pids: set[int]) -> set[int]:
    """Which of the processes ``pids`` hold a worker connection to ``dsn`` (the server's
    client port of each connection, matched with the processes' sockets)."""
    import psutil

    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE 'outboxkit-worker%'"
        ).fetchall()
    ports = {int(port) for (port,) in rows if port is not None}
    return {
        pid
        for pid in pids
        if any(c.laddr and c.laddr.port in ports for c in psutil.Process(pid).net_connections())
    }


def _logs(directory: Path) -> str:
    return "\n".join(p.read_text()[-1500:] for p in sorted(directory.glob("worker-*.log")))


async def test_two_worker_processes_given_one_file_divide_its_databases(
    task_databases: list[str], tmp_path: Path
) -> None:
    """The relay's shared-file test for workers: each database is worked on by one of the two
    processes (its lease owner; the other holds no connection to it), two each at most; a
    SIGKILLed one's databases are taken over within the lease, and each task's effect
    commits once (fenced by the task's lease: a takeover does not run it twice)."""
    dsns = task_databases
    dsn_file = tmp_path / "databases.txt"
    dsn_file.write_text("".join(f"w{i} {dsn}\n" for i, dsn in enumerate(dsns)))
    lease = "3"
    workers = {}
    for i in range(2):
        process = _spawn(dsn_file, tmp_path / f"worker-{i}.log", "--fleet-lease", lease)
        workers[process.pid] = process

    def divided() -> bool:
        owners = [_owner_pid(dsn) for dsn in dsns]
        if any(pid not in workers for pid in owners):
            return False
        # (3 databases, 2 processes: 2 and 1, never 3 and 0)
        return len(set(owners)) == len(workers) if len(workers) > 1 else True

    try:
        await wait_for(divided, timeout=15, interval=0.2, what="the databases divided")
        for dsn in dsns:
            _enqueue(dsn)
        for dsn in dsns:
            await wait_for(lambda dsn=dsn: _effects(dsn) == TASKS_EACH, timeout=15)
        # the non-owner stays off: only the owner holds worker connections to a database
        # (a database handed back in the first rounds closes its connections at once)
        owned_by = {dsn: _owner_pid(dsn) for dsn in dsns}
        only_owner = {dsn: {pid} for dsn, pid in owned_by.items()}
        await wait_for(
            lambda: {dsn: _connected_pids(dsn, set(workers)) for dsn in dsns} == only_owner,
            timeout=5,
            what=f"only the owners {owned_by} connected",
        )

        victim = next(iter(workers.values()))
        lost = [dsn for dsn, pid in owned_by.items() if pid == victim.pid]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        del workers[victim.pid]
        for dsn in lost:
            _enqueue(dsn)
        await wait_for(divided, timeout=float(lease) * 2 + 3, interval=0.2, what="taken over")
        for dsn in lost:
            await wait_for(lambda dsn=dsn: _effects(dsn) == 2 * TASKS_EACH, timeout=15)
    finally:
        for process in workers.values():
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(30) for process in workers.values()]
    assert codes == [0], _logs(tmp_path)
    assert lost, "the killed process owned a database"
    for dsn in dsns:
        with psycopg.connect(dsn, autocommit=True) as conn:
            twice = conn.execute(
                "SELECT count(*) FROM (SELECT task_id FROM effects GROUP BY 1"
                " HAVING count(*) > 1) t"
            ).fetchone()
        assert twice == (0,), dsn


PASSWORD = "worker-fleet-pw-1"
WRONG = "wrong-worker-pw-2"


def _scrape(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _samples(body: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def _value(body: str, name: str, **labels: str) -> float | None:
    return _samples(body).get((name, frozenset(labels.items())))


async def test_a_worker_fleet_serves_each_databases_task_metrics_under_its_name(
    task_databases: list[str], tmp_path: Path
) -> None:
    """`worker --dsn-file --metrics-port`: each database's task counts under its `database`
    label, equal to what ran there; its table gauges read at scrape time; a wrong password's
    line named by /readyz while the others are served; a database whose table does not
    answer (locked) reported down within the scrape's time box, not holding it."""
    first, second, locked = task_databases
    ran = {"w0": (first, 12), "w1": (second, 5), "w2": (locked, 3)}
    for dsn, n in ran.values():
        with psycopg.connect(dsn) as conn, conn.transaction():
            for _ in range(n):
                tasks.enqueue(conn, "effect", {"ms": 1})
    with psycopg.connect(second) as conn, conn.transaction():  # (w1: 2 due in an hour)
        for _ in range(2):
            tasks.enqueue(conn, "effect", {"ms": 1}, delay=3600)
    with password_postgres("worker_pw", PASSWORD, "fleet") as server:
        wrong = f"postgresql://worker_pw:{WRONG}@127.0.0.1:{server.port}/fleet"
        lines = [*(f"{name} {dsn}" for name, (dsn, _n) in ran.items()), f"wrongpw {wrong}"]
        dsn_file = tmp_path / "databases.txt"
        dsn_file.write_text("\n".join(lines) + "\n")
        port = free_port()
        log_path = tmp_path / "worker.log"
        worker = _spawn(dsn_file, log_path, "--metrics-port", str(port))
        try:
            for dsn, n in ran.values():
                await wait_for(lambda dsn=dsn, n=n: _effects(dsn) == n, timeout=15)

            def counted() -> bool:
                body = _scrape(port, "/metrics")[1]
                done = "outboxkit_tasks_finished_total"
                return all(
                    _value(body, done, task="effect", outcome="done", database=name) == n
                    for name, (_dsn, n) in ran.items()
                )

            await wait_for(counted, timeout=10, interval=0.3, what="each database's counts")
            status, body = _scrape(port, "/metrics")
            assert status == 200
            for name, (dsn, n) in ran.items():  # (the database's side: one effect per task)
                done = _value(
                    body, "outboxkit_tasks_finished_total", task="effect", outcome="done",
                    database=name,
                )  # fmt: skip
                assert done == _effects(dsn) == n, name
                assert _value(body, "outboxkit_fleet_database_up", database=name) == 1
            scheduled = "outboxkit_tasks_scheduled"
            assert _value(body, scheduled, task="effect", database="w1") == 2, body[-3000:]
            assert _value(body, "outboxkit_fleet_database_up", database="wrongpw") == 0
            assert not any("wrongpw" in str(k) for k in _samples(body) if "up" not in k[0])
            status, ready = _scrape(port, "/readyz")
            assert status == 503 and "wrongpw" in ready, ready
            assert "w0" not in ready and "w1" not in ready, ready
            assert _scrape(port, "/healthz")[0] == 200

            # A table that does not answer: w2's locked, so a read of it waits (the naive
            # scrape, reading each table in turn, would wait with it).
            with psycopg.connect(locked) as holder:
                holder.execute("LOCK TABLE outboxkit_tasks IN ACCESS EXCLUSIVE MODE")
                timed = "-c statement_timeout=1000"
                with pytest.raises(psycopg.errors.QueryCanceled):
                    with psycopg.connect(locked, options=timed, autocommit=True) as naive:
                        naive.execute("SELECT count(*) FROM outboxkit_tasks")
                await asyncio.sleep(1.1)  # (past the scrape's 1 s cache)
                started = time.monotonic()
                status, body = await asyncio.to_thread(_scrape, port, "/metrics")
                took = time.monotonic() - started
                holder.rollback()
            assert status == 200 and took < 4, took
            assert _value(body, "outboxkit_fleet_database_up", database="w2") == 0
            assert _value(body, "outboxkit_fleet_database_up", database="w0") == 1
            assert _value(body, scheduled, task="effect", database="w1") == 2
            assert _value(body, scheduled, task="effect", database="w2") is None
            await asyncio.sleep(1.1)
            _status, body = _scrape(port, "/metrics")
            assert _value(body, "outboxkit_fleet_database_up", database="w2") == 1, "back"
        finally:
            worker.send_signal(signal.SIGTERM)
            code = worker.wait(30)
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert "database wrongpw (line 4) is not served" in text, text
    assert "password authentication failed" in text, text
    gauge_lines = [line for line in text.splitlines() if "gauges could not be read" in line]
    assert gauge_lines and all("[w2]" in line for line in gauge_lines), gauge_lines
    for seen in (text, body, ready):
        assert WRONG not in seen and PASSWORD not in seen


async def test_status_shows_each_databases_task_table_and_its_worker(
    task_databases: list[str], tmp_path: Path
) -> None:
    """`status --dsn-file` over a worker fleet's databases: each task table's counts and
    oldest queued age from the database, the fleet process holding its worker lease; a
    database with a task table and no outbox table is no error (the outbox-only reading
    called each of them unreachable)."""
    from click.testing import CliRunner

    from outboxkit.backends import backend_for
    from outboxkit.ops.cli.app import main

    tasked, mixed, idle = task_databases
    with psycopg.connect(tasked) as conn, conn.transaction():
        for _ in range(3):
            tasks.enqueue(conn, "effect", {"ms": 1})
        tasks.enqueue(conn, "effect", {"ms": 1}, delay=3600)
    migrate(mixed, table="outbox")
    lease = backend_for(tasked).fleet_lease(tasked, "worker:outboxkit_tasks", "host:1:ab", 30)
    await lease.check(True)
    dsn_file = tmp_path / "databases.txt"
    lines = [
        f"tasked {tasked}",
        f"mixed {mixed}",
        f"idle {idle}",
        "ghost postgresql://x@no.invalid/x",
    ]
    dsn_file.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(main, ["status", "--dsn-file", str(dsn_file), "--json"])
    assert result.exit_code == 1, result.output  # (ghost)
    by_name = {d["name"]: d for d in json.loads(result.output)["databases"]}
    with psycopg.connect(tasked, autocommit=True) as conn:
        due = conn.execute(
            "SELECT count(*) FROM outboxkit_tasks WHERE available_at <= now()"
        ).fetchone()
    shown = by_name["tasked"]["tasks"]
    assert (shown["queued"], shown["scheduled"], shown["running"]) == (due[0], 1, 0) == (3, 1, 0)
    assert shown["oldest_queued_age_s"] is not None and shown["owner"] == "host:1:ab"
    assert by_name["tasked"]["error"] is None and by_name["tasked"]["pending"] is None
    assert by_name["mixed"]["pending"] == 0 and by_name["mixed"]["tasks"]["queued"] == 0
    assert by_name["idle"]["tasks"]["owner"] is None and by_name["idle"]["error"] is None
    assert by_name["ghost"]["tasks"] is None and "no.invalid" in by_name["ghost"]["error"]

    table = CliRunner().invoke(main, ["status", "--dsn-file", str(dsn_file)])
    assert "outboxkit_tasks in the databases of" in table.output, table.output
    assert "host:1:ab" in table.output and "no outbox table" in table.output, table.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--dsn", "postgresql://db/x", "--dsn-file", "f"], "give one of them"),
        (["--dsn-file", "f", "--direct-dsn", "postgresql://db/x"], "--direct-dsn cannot be used"),
    ],
)
def test_worker_takes_one_database_or_a_file_of_them(
    args: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from outboxkit.ops.cli.app import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUTBOXKIT_DSN", raising=False)
    monkeypatch.syspath_prepend(str(ROOT))
    (tmp_path / "f").write_text("")
    command = ["worker", "--app", "tests.support.tasks_app:tasks", *args]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 2, result.output
    assert said in result.output, result.output
