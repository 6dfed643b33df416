"""Fairness between keys: a light key's wait while another key's flood drains, side by side.

Each run: ``--flood`` no-op tasks of one key enqueued first, then one ``outboxkit worker
--dsn ... --app tasks_app:fairness_tasks`` process with its defaults; from its first claim on, a
light key enqueues one task every 100 ms until the flood is drained (and at least
``--light`` tasks). Each light task records its wait, from the database's clock just before
its enqueue's COMMIT to its handler's start, by the same clock (bench/tasks_app.py). The
flood's drain time is timed from the database's side (from its first claim to an empty
table, polled every 20 ms). Runs, in one invocation:

* ``empty``: the light key alone on an empty queue (a ``fair=True`` name);
* ``fair``: the flood of one key and the light key, ``@tasks.handler(..., fair=True)``;
* ``unfair``: the same without fair=, the flood enqueued without a key (a queue in id
  order: the light key waits behind the whole flood);
* ``serial``: a keyed flood without fair= (serial per key, the default), ``--serial-flood``
  tasks: how fast one key drains one at a time;
* ``burst`` and ``burst, as before``: no flood, the light key (fair) enqueues one task every
  ``--burst-every`` seconds, faster than a claim round; the second with the worker's fair
  names deleted from ``<table>_fair`` once it claims (each such task then waits for a
  promotion whenever one of its key is live, as before task table version 11).

    PYTHONPATH=src:. python bench/tasks_fairness.py --dsn postgresql://postgres@localhost/postgres
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.queue.tasks import FAIR_SHARE

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from tasks_app import fairness_tasks as tasks  # noqa: E402  (the app the worker loads)


def _count(conn: psycopg.Connection[Any], name: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM outboxkit_tasks WHERE task_name = %s AND payload = '{}'::jsonb",
        (name,),
    ).fetchone()
    return int(row[0]) if row is not None else 0


def run(
    dsn: str,
    label: str,
    name: str,
    flood: int,
    flood_key: str | None,
    light: int,
    every: float = 0.1,
    forget_fair: bool = False,
) -> dict[str, Any]:
    """One run: the flood, the worker, the light key's tasks one every ``every`` seconds;
    its waits and the drain. ``forget_fair``: the worker's fair names deleted from the
    table once it claims (the enqueue then works as before task table version 11)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outboxkit_tasks")
        conn.execute("DELETE FROM bench_light_waits WHERE run = %s", (label,))
    with psycopg.connect(dsn) as conn, conn.transaction():
        for _ in range(flood):
            tasks.enqueue(conn, name, {}, key=flood_key)
    path = [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "OKB_DSN": dsn, "PYTHONPATH": os.pathsep.join([str(HERE), *path])}
    argv = [sys.executable, "-m", "outboxkit", "worker", "--dsn", dsn,
            "--app", "tasks_app:fairness_tasks", "--log-level", "WARNING"]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        worker = subprocess.Popen(argv, cwd=HERE, env=env, stdout=log, stderr=log)
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                deadline = time.monotonic() + 60
                ready = (
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND application_name = 'outboxkit-worker:claim'"
                )
                while (flood and _count(conn, name) == flood) or (  # its first claim
                    not flood and conn.execute(ready).fetchone() == (0,)
                ):
                    assert worker.poll() is None, "the worker ended"
                    assert time.monotonic() < deadline, "no claim"
                    time.sleep(0.005)
                time.sleep(0.0 if flood else 0.5)  # (started: its LISTEN and first poll)
                if forget_fair:
                    conn.execute("DELETE FROM outboxkit_tasks_fair")
                began, drained, sent = time.perf_counter(), None, 0
                next_at = began
                while drained is None or sent < light:
                    now = time.perf_counter()
                    if now >= next_at:
                        with conn.transaction():
                            row = conn.execute(
                                "SELECT extract(epoch FROM clock_timestamp())::float8"
                            ).fetchone()
                            assert row is not None
                            tasks.enqueue(conn, name, {"run": label, "at": row[0]}, key="light")
                        sent += 1
                        next_at += every
                    if drained is None and _count(conn, name) == 0:
                        drained = time.perf_counter() - began
                    time.sleep(min(0.02, max(0.0, next_at - time.perf_counter())))
                deadline = time.monotonic() + 120
                while True:
                    row = conn.execute(
                        "SELECT count(*) FROM bench_light_waits WHERE run = %s", (label,)
                    ).fetchone()
                    if row is not None and row[0] >= sent:
                        break
                    assert time.monotonic() < deadline, "light tasks not run"
                    time.sleep(0.05)
                waits = sorted(
                    float(w) for (w,) in conn.execute(
                        "SELECT wait FROM bench_light_waits WHERE run = %s", (label,)
                    ).fetchall()
                )  # fmt: skip
        finally:
            worker.terminate()
            worker.wait(30)
    p = statistics.quantiles(waits, n=100, method="inclusive")
    result = {
        "run": label, "flood": flood, "light_tasks": len(waits),
        "wait_p50_ms": round(p[49] * 1000, 1), "wait_p99_ms": round(p[98] * 1000, 1),
        "wait_max_ms": round(waits[-1] * 1000, 1),
        "flood_drain_s": None if not flood else round(drained or 0.0, 2),
        "flood_tasks_per_s": None if not flood or not drained else round(flood / drained),
    }  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--flood", type=int, default=50_000)
    parser.add_argument("--serial-flood", type=int, default=2_000)
    parser.add_argument("--light", type=int, default=100, help="at least this many light tasks")
    parser.add_argument(
        "--burst-every", type=float, default=0.005,
        help="the bursting key's runs: one task every this many seconds, no flood",
    )  # fmt: skip
    parser.add_argument("--out", default=str(HERE / "results" / "tasks_fairness.json"))
    args = parser.parse_args()
    migrate_tasks(args.dsn)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_light_waits (run text, wait float8)")
    results = [
        run(args.dsn, "empty", "fairness.fair", 0, None, args.light),
        run(args.dsn, "fair", "fairness.fair", args.flood, "flood", args.light),
        run(args.dsn, "unfair", "fairness.plain", args.flood, None, args.light),
        run(args.dsn, "serial", "fairness.plain", args.serial_flood, "flood", 10),
        # A fair key that enqueues faster than a claim round: pending at once while its
        # key has room (version 11), and as before (each waiting for a promotion).
        run(args.dsn, "burst", "fairness.fair", 0, None, args.light, args.burst_every),
        run(
            args.dsn,
            "burst, as before",
            "fairness.fair",
            0,
            None,
            args.light,
            args.burst_every,
            forget_fair=True,
        ),
    ]
    empty = results[0]
    for r in results[1:]:
        r["p99_vs_empty"] = round(r["wait_p99_ms"] / empty["wait_p99_ms"], 1)
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "fair_share": FAIR_SHARE,
        "command": "PYTHONPATH=src:. python bench/tasks_fairness.py --dsn ... "
        f"--flood {args.flood} --serial-flood {args.serial_flood} --light {args.light}"
        f" --burst-every {args.burst_every}",
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
