"""What a full concurrency limit costs the queue's claims: before and after parking.

Fills a task table with ``--running`` running tasks of the limited name ``lim`` (its
``concurrency=N`` full), ``--waiting`` tasks of ``lim`` due behind them and ``--others``
tasks of another name enqueued after, then times (``EXPLAIN (ANALYZE, BUFFERS)``, rolled
back, median of ``--runs``) the queue's claim of the other names and ``lim``'s own claim
with every ``lim`` task pending (as before task table version 10), then parks them as the
workers' sweep does (PARK_NAME, timed) and times the same claims again (after one vacuum,
whose emptied claim-index pages the next one reclaims, and after that), with the sweep's
steady cost (the promotion and a park with nothing to park) and a claim's promotion.

    PYTHONPATH=src:. python bench/tasks_name_limit.py --dsn postgresql://...
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import psycopg
from bench.tasks_key_limits import time_claim

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.tasks_sql import TaskStatements
from outboxkit.queue.tasks import TaskStatus

TABLE = "bench_name_limit"


def fill(conn: psycopg.Connection[Any], running: int, waiting: int, others: int) -> None:
    conn.execute(f"TRUNCATE {TABLE}")
    for name, status, count, at in (
        ("lim", TaskStatus.RUNNING, running, "now() + interval '1 hour'"),
        ("lim", TaskStatus.PENDING, waiting, "now() - interval '1 hour'"),
        ("other", TaskStatus.PENDING, others, "now() - interval '1 minute'"),
    ):
        conn.execute(
            f"INSERT INTO {TABLE} (task_name, status, available_at)"
            f" SELECT %s, %s, {at} FROM generate_series(1, %s)",
            (name, int(status), count),
        )
    conn.execute(f"VACUUM ANALYZE {TABLE}")


def timed(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> float:
    started = time.perf_counter()
    conn.execute(statement, params)
    return (time.perf_counter() - started) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--running", type=int, default=4)
    ap.add_argument("--waiting", type=int, default=100_000)
    ap.add_argument("--others", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "tasks_name_limit.json")
    )
    args = ap.parse_args()
    migrate_tasks(args.dsn, table=TABLE)
    s = TaskStatements(TABLE)
    base = {"queue": "default", "alone": False, "limit": args.limit, "lease": 30.0,
            "owner": "bench", "max_attempts": 5, "names": ["other"], "name": None,
            "concurrency": None, "rate": None, "burst": 1, "skip": ["lim"], "per_key": 1,
            "key_rate": None, "key_burst": 1, "fair": False}  # fmt: skip
    own = {**base, "names": None, "name": "lim", "concurrency": args.running, "skip": []}
    sweep = {"name": "lim", "queue": "default", "keep": args.running, "count": args.running}
    results: dict[str, Any] = {k: getattr(args, k) for k in ("running", "waiting", "others")}
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        fill(conn, args.running, args.waiting, args.others)
        results["before: the queue's claim of its other names"] = time_claim(
            conn, s.claim, base, args.runs
        )
        results["before: the limited name's claim (full)"] = time_claim(
            conn, s.claim_limited, own, args.runs
        )
        results["parking them (once, ms)"] = timed(
            conn, s.park_name, {**sweep, "limit": args.waiting + args.running}
        )
        conn.execute(f"VACUUM ANALYZE {TABLE}")
        results["parked, one vacuum: the queue's other claim"] = time_claim(
            conn, s.claim, base, args.runs
        )
        conn.execute(f"VACUUM {TABLE}")  # (the empty index pages the first one left)
        results["after: the queue's claim of its other names"] = time_claim(
            conn, s.claim, base, args.runs
        )
        results["after: the limited name's claim (full)"] = time_claim(
            conn, s.claim_limited, own, args.runs
        )
        results["after: a claim's promotion of 4"] = time_claim(
            conn, s.promote_name, sweep, args.runs
        )
        results["after: the sweep's park, nothing to park"] = time_claim(
            conn, s.park_name, {**sweep, "limit": 1000 + args.running}, args.runs
        )
    for what, r in results.items():
        if isinstance(r, dict):
            print(f"{what:>46}: {r['ms']:7.2f} ms, {r['buffers']:6.0f} buffers, {r['rows']} rows")
        else:
            print(f"{what:>46}: {r}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
