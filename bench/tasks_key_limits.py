"""What the per-key limits cost the claim: the worker's claim statements on a scratch table.

Fills a task table with ``--keys`` keys of one task name, each with ``--per-key`` tasks
pending and ``--waiting`` waiting for their key's turn (enqueued behind them), then times
each claim (``EXPLAIN (ANALYZE, BUFFERS)``, rolled back, so every run sees the same table)
as the worker sends it: the queue's plain claim (serial keys), the name's own claim with
``concurrency_per_key``, with ``rate_per_key`` too, and the same with every key's bucket
empty (the claim then takes nothing and walks every pending task of the name). Prints the
median time and buffers of ``--runs`` runs each, and saves the JSON.

    PYTHONPATH=src:. python bench/tasks_key_limits.py --dsn postgresql://...
"""

from __future__ import annotations

import argparse
import json
import statistics
import uuid
from pathlib import Path
from typing import Any

import psycopg

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.tasks_sql import TaskStatements, key_rates_table_name
from outboxkit.queue.tasks import TaskStatus

TABLE = "bench_key_limits"


def fill(conn: psycopg.Connection[Any], keys: int, per_key: int, waiting: int) -> None:
    conn.execute(f"TRUNCATE {TABLE}, {key_rates_table_name(TABLE)}")
    for status, count in ((TaskStatus.PENDING, per_key), (TaskStatus.WAITING, waiting)):
        conn.execute(
            f"INSERT INTO {TABLE} (task_name, key, status)"
            " SELECT 'fan', 'k' || k, %s FROM generate_series(1, %s) AS k,"
            " generate_series(1, %s) AS n ORDER BY n, k",
            (int(status), keys, count),
        )
    conn.execute(f"VACUUM ANALYZE {TABLE}")


def time_claim(
    conn: psycopg.Connection[Any], statement: str, params: dict[str, Any], runs: int
) -> dict[str, Any]:
    """Median execution time and shared buffers of the claim, each run rolled back."""
    times, buffers, claimed = [], [], 0
    for _ in range(runs):
        with conn.transaction(force_rollback=True):
            conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
            cur = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement,
                {**params, "token": uuid.uuid4()},
            )
            row = cur.fetchone()
            assert row is not None
            plan = row[0][0]
            times.append(plan["Execution Time"])
            top = plan["Plan"]
            buffers.append(top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0))
            claimed = int(top.get("Actual Rows", 0))
    return {"ms": statistics.median(times), "buffers": statistics.median(buffers),
            "rows": claimed}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--per-key", type=int, default=2)
    ap.add_argument("--waiting", type=int, default=100)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "tasks_key_limits.json")
    )
    args = ap.parse_args()
    migrate_tasks(args.dsn, table=TABLE)
    s = TaskStatements(TABLE)
    base = {"queue": "default", "alone": False, "limit": args.limit, "lease": 30.0,
            "owner": "bench", "max_attempts": 5, "names": ["fan"], "name": None,
            "concurrency": None, "rate": None, "burst": 1, "skip": [], "per_key": 1,
            "key_rate": None, "key_burst": 1}  # fmt: skip
    own = {**base, "name": "fan", "names": None, "per_key": args.per_key}
    rated = {**own, "key_rate": 10.0, "key_burst": 1}
    results: dict[str, Any] = {
        "keys": args.keys,
        "per_key": args.per_key,
        "waiting": args.keys * args.waiting,
        "limit": args.limit,
    }
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        fill(conn, args.keys, 1, args.waiting)  # serial keys: each key's head pending
        results["plain claim, serial keys"] = time_claim(conn, s.claim, base, args.runs)
        fill(conn, args.keys, args.per_key, args.waiting)
        results["concurrency_per_key claim"] = time_claim(conn, s.claim_limited, own, args.runs)
        results["with rate_per_key"] = time_claim(conn, s.claim_limited, rated, args.runs)
        conn.execute(
            f"INSERT INTO {key_rates_table_name(TABLE)} (task_name, key, tokens, rate, burst)"
            " SELECT 'fan', 'k' || k, 0, 10, 1 FROM generate_series(1, %s) AS k",
            (args.keys,),
        )
        conn.execute(f"ANALYZE {key_rates_table_name(TABLE)}")
        empty = {**rated, "key_rate": 0.001}  # (no token refills while it is timed)
        results["every key's bucket empty"] = time_claim(conn, s.claim_limited, empty, args.runs)
    for what, r in results.items():
        if isinstance(r, dict):
            print(f"{what:>28}: {r['ms']:7.2f} ms, {r['buffers']:6.0f} buffers, {r['rows']} rows")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
