"""Task latency on MariaDB beside PostgreSQL: enqueue COMMIT to handler start, in a worker process.

An ``outboxkit worker`` process (the library's defaults: ``--poll-interval`` 1 s, linger
30 ms) runs this module's ``ping`` handler, which appends (task number, start time) to a
file. This process enqueues one task per transaction from PyMySQL (MariaDB) or psycopg
(PostgreSQL), paced: ``--rate`` tasks/s for ``--seconds`` (steady), then ``--sparse-rate``
for ``--sparse-seconds`` (tasks further apart than the worker's linger, so each finds it
waiting: woken by NOTIFY on PostgreSQL, by its next poll on MariaDB, which has no LISTEN and
whose enqueue from another process wakes nobody). Latency is from the COMMIT returned to
the handler's start (and from before the INSERT), p50 / p90 / p99 / max in ms, the two
databases taking turns, ``--rounds`` each. What the polling costs: statements the server
ran per second while the worker idled (MariaDB ``Questions``, PostgreSQL's transactions),
and the worker's CPU per task. MariaDB is the tests' private ``mariadbd`` with durable
commits (bench/mariadb.py's ``DurableMariaDB``); PostgreSQL the ``--dsn`` given.

    python bench/mariadb_tasks_latency.py --dsn postgresql://postgres@127.0.0.1:5432/bench_latency
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from outboxkit.tasks import Tasks

ROOT = Path(__file__).resolve().parents[1]
TABLE = "outboxkit_tasks"
tasks = Tasks()
#: The worker process's log of handler starts (line-buffered); None in this process.
_LOG = (
    open(os.environ["OKB_LATENCY_LOG"], "a", buffering=1)  # noqa: SIM115 - the process's
    if "OKB_LATENCY_LOG" in os.environ
    else None
)


@tasks.handler("ping")
async def ping(payload: list[float]) -> None:
    """Runs in the worker process: its start time, appended at once."""
    started = time.time()
    assert _LOG is not None, "the worker process is started with OKB_LATENCY_LOG"
    _LOG.write(f"{int(payload[0])} {started}\n")


# -- the two databases: a connection that enqueues, and the server's statement counter ------


def _mariadb_enqueue(url: str) -> tuple[Callable[[int], float], Callable[[], None]]:
    import pymysql

    from outboxkit.backends.mariadb.sql import connect_args

    conn = pymysql.connect(**connect_args(url))

    def one(n: int) -> float:
        conn.begin()
        tasks.enqueue(conn, "ping", [n, time.time()])
        conn.commit()
        return time.time()

    return one, conn.close


def _pg_enqueue(dsn: str) -> tuple[Callable[[int], float], Callable[[], None]]:
    import psycopg

    conn = psycopg.connect(dsn)

    def one(n: int) -> float:
        with conn.transaction():
            tasks.enqueue(conn, "ping", [n, time.time()])
        return time.time()

    return one, conn.close


def _mariadb_statements(url: str) -> float:
    """Statements the server has run (every client: here, only the worker and this one)."""
    from tests.support.mariadb_ops import mariadb_execute

    return float(mariadb_execute(url, "SHOW GLOBAL STATUS LIKE 'Questions'")[0][1])


def _pg_statements(dsn: str) -> float:
    """Transactions committed and rolled back in the bench database (other databases'
    clients are not counted)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database"
            " WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return float(row[0])


# -- one run ---------------------------------------------------------------------------------


@contextmanager
def _worker(url: str, log: Path, *options: str) -> Iterator[subprocess.Popen[bytes]]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")},
        "OKB_LATENCY_LOG": str(log),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT / "src"), str(ROOT)]),
    }
    command = [sys.executable, "-m", "outboxkit", "worker", "--dsn", url,
               "--app", "mariadb_tasks_latency:tasks", *options]  # fmt: skip
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _started(log: Path) -> dict[int, float]:
    if not log.exists():
        return {}
    out = {}
    for line in log.read_text().splitlines():
        n, at = line.split()
        out[int(n)] = float(at)
    return out


def _wait_for(log: Path, numbers: set[int], timeout: float = 60.0) -> dict[int, float]:
    deadline = time.monotonic() + timeout
    while not numbers <= (seen := _started(log)).keys():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(numbers - seen.keys())} tasks never started")
        time.sleep(0.05)
    return seen


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _by_second(
    sent: dict[int, tuple[float, float]], seen: dict[int, float]
) -> dict[int, list[float]]:
    first = min(c for _b, c in sent.values())
    out: dict[int, list[float]] = {}
    for n, (_b, c) in sent.items():
        out.setdefault(int(c - first), []).append((seen[n] - c) * 1000)
    return out


def _pct(values: list[float]) -> dict[str, float]:
    if len(values) < 2:  # (a --quick run's few sparse tasks)
        return {"p50_ms": values[0], "p90_ms": values[0], "p99_ms": values[0], "max_ms": values[0]}
    q = statistics.quantiles(values, n=100)
    return {"p50_ms": q[49], "p90_ms": q[89], "p99_ms": q[98], "max_ms": max(values)}


def _paced(
    enqueues: list[Callable[[int], float]], first: int, rate: float, seconds: float
) -> dict[int, tuple[float, float]]:
    """Enqueue at ``rate`` in all, task ``first + i`` due at ``i / rate`` s, by as many
    writers (threads, a connection each) as ``enqueues``: one durable COMMIT takes 4-8 ms on
    this machine, so one writer alone falls short of 200/s. Number -> (before the INSERT,
    COMMIT returned)."""
    sent: dict[int, tuple[float, float]] = {}
    count = int(rate * seconds)
    start = time.perf_counter()

    def write(w: int) -> None:
        for i in range(w, count, len(enqueues)):
            time.sleep(max(0.0, start + i / rate - time.perf_counter()))
            before = time.time()
            sent[first + i] = (before, enqueues[w](first + i))

    with concurrent.futures.ThreadPoolExecutor(len(enqueues)) as pool:
        list(pool.map(write, range(len(enqueues))))
    return sent


def run_one(
    name: str,
    url: str,
    connect: Callable[[str], tuple[Callable[[int], float], Callable[[], None]]],
    statements: Callable[[str], float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    log = Path(tempfile.mkdtemp(prefix="okb-latency-")) / "started.log"
    writers = [connect(url) for _ in range(max(1, args.writers))]
    enqueues = [enqueue for enqueue, _close in writers]
    enqueue = enqueues[0]
    try:
        poll = [] if args.poll_interval is None else ["--poll-interval", str(args.poll_interval)]
        with _worker(url, log, *poll) as proc:
            enqueue(-1)  # the worker is up and warm once this one ran
            _wait_for(log, {-1})
            time.sleep(2.0)  # past its linger: idle, polling (MariaDB) or listening
            s0, t0 = statements(url), time.monotonic()
            time.sleep(args.idle_seconds)
            idle_per_s = (statements(url) - s0) / (time.monotonic() - t0)
            cpu0 = _cpu_seconds(proc.pid)
            t0 = time.monotonic()
            steady = _paced(enqueues, 0, args.rate, args.seconds)
            achieved = len(steady) / (time.monotonic() - t0)
            seen = _wait_for(log, set(steady))
            cpu_per_task_ms = (_cpu_seconds(proc.pid) - cpu0) / len(steady) * 1000
            sparse = _paced(enqueues[:1], len(steady), args.sparse_rate, args.sparse_seconds)
            seen = _wait_for(log, set(sparse))
    finally:
        for _enqueue, close in writers:
            close()

    def part(sent: dict[int, tuple[float, float]]) -> dict[str, Any]:
        first = min(c for _b, c in sent.values())
        return {
            "tasks": len(sent),
            "from_commit": _pct([(seen[n] - c) * 1000 for n, (_b, c) in sent.items()]),
            "from_enqueue": _pct([(seen[n] - b) * 1000 for n, (b, _c) in sent.items()]),
            # without the first second: the burst's start finds MariaDB's worker asleep
            "after_first_second": _pct(
                [(seen[n] - c) * 1000 for n, (_b, c) in sent.items() if c - first >= 1.0]
            ),
            "commit_ms_p50": statistics.median((c - b) * 1000 for b, c in sent.values()),
            # each second's median from the COMMIT: a start-up or a stall shows where it was
            "per_second_p50_ms": [
                round(statistics.median(v), 1) for v in _by_second(sent, seen).values()
            ],
        }

    result = {
        "database": name,
        "steady": {
            "rate": args.rate,
            "achieved_rate": achieved,
            "writers": len(enqueues),
            "seconds": args.seconds,
            **part(steady),
        },
        "sparse": {"rate": args.sparse_rate, "seconds": args.sparse_seconds, **part(sparse)},
        "idle_statements_per_s": idle_per_s,
        "worker_cpu_ms_per_task_steady": cpu_per_task_ms,
    }
    s, p = result["steady"]["from_commit"], result["sparse"]["from_commit"]
    w = result["steady"]["after_first_second"]
    print(
        f"{name}: {achieved:.0f}/s p50 {s['p50_ms']:.1f} p99 {s['p99_ms']:.1f} ms"
        f" (after 1 s: p50 {w['p50_ms']:.1f} p99 {w['p99_ms']:.1f});"
        f" {args.sparse_rate:g}/s p50 {p['p50_ms']:.1f} p99 {p['p99_ms']:.1f} ms;"
        f" idle {idle_per_s:.1f} statements/s; {cpu_per_task_ms:.2f} ms worker CPU/task",
        flush=True,
    )
    return result


def main() -> None:
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
    from _common import save, server_facts
    from mariadb import DurableMariaDB  # bench/mariadb.py (the tests' private server, durable)
    from tests.support.mariadb_ops import mariadb_execute

    from outboxkit.backends.mariadb.migrate import migrate as mariadb_migrate
    from outboxkit.tasks import migrate_tasks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True, help="PostgreSQL, for the side-by-side figure")
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--writers", type=int, default=4, help="threads enqueuing, a connection each")
    ap.add_argument("--sparse-rate", type=float, default=2.0)
    ap.add_argument("--sparse-seconds", type=float, default=10.0)
    ap.add_argument("--idle-seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--poll-interval", type=float, default=None, help="the workers' (default: the library's)"
    )
    ap.add_argument(
        "--flush", type=int, default=1, help="innodb_flush_log_at_trx_commit (1: durable)"
    )
    ap.add_argument("--name", default="mariadb_tasks_latency")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 s, 2 s, 1 s")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.sparse_seconds, args.idle_seconds = 3.0, 2.0, 1.0

    import psycopg

    server = DurableMariaDB(args.flush)
    server.start()
    try:
        mariadb_execute(server.url_for("mysql"), "CREATE DATABASE bench_latency")
        url = server.url_for("bench_latency")
        mariadb_migrate(url, kind="tasks", table=TABLE)
        migrate_tasks(args.dsn)
        version = mariadb_execute(url, "SELECT VERSION()")[0][0]
        rounds: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            mariadb_execute(url, f"TRUNCATE {TABLE}")
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                conn.execute(f"TRUNCATE {TABLE}")
            rounds.append(run_one("MariaDB", url, _mariadb_enqueue, _mariadb_statements, args))
            rounds.append(run_one("PostgreSQL", args.dsn, _pg_enqueue, _pg_statements, args))
    finally:
        server.close()
    save(
        args.name,
        {
            "command": " ".join(["python", *sys.argv]),
            "machine": {**server_facts(args.dsn), "loadavg_end": os.getloadavg()},
            "mariadb": {"version": version, "innodb_flush_log_at_trx_commit": args.flush},
            "worker": "outboxkit worker --dsn … --app mariadb_tasks_latency:tasks"
            + ("" if args.poll_interval is None else f" --poll-interval {args.poll_interval}"),
            "runs": rounds,
        },
    )


if __name__ == "__main__":
    main()
