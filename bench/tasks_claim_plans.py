"""The task claim and its settle, prepared, under PostgreSQL's custom and generic plans.

Fills a scratch task table with N tasks and drains it ``--limit`` at a time through the
worker's own statements (``TaskStatements.claim`` and ``settle_done_delete``), prepared as
psycopg prepares them, once with the server's default ``plan_cache_mode`` and once with
``force_generic_plan``; prints the time per claim + settle and what
``pg_prepared_statements`` says about the plans (generic, custom), and saves the JSON.
Run a base tree against this one by putting it first on ``PYTHONPATH`` (an A/B).

    cd bench && PYTHONPATH=../src:. python tasks_claim_plans.py --dsn postgresql://...
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.tasks_sql import TaskStatements

TABLE = "bench_claim_plans"


def drain(dsn: str, tasks: int, limit: int, mode: str | None) -> dict[str, Any]:
    s = TaskStatements(TABLE)
    params = {"limit": limit, "lease": 30.0, "owner": "bench", "max_attempts": 5,
              "queue": "default", "names": ["noop"], "alone": False}  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLE}")
        conn.execute(
            f"INSERT INTO {TABLE} (task_name) SELECT 'noop' FROM generate_series(1, %s)", (tasks,)
        )
        conn.execute(f"VACUUM ANALYZE {TABLE}")
        if mode:
            conn.execute(f"SET plan_cache_mode = {mode}")
        pairs, started = 0, time.perf_counter()
        while True:
            token = uuid.uuid4()
            rows = conn.execute(s.claim, {**params, "token": token}, prepare=True).fetchall()
            ids = [r[0] for r in rows if r[0] is not None]
            if not ids:
                break
            conn.execute(s.settle_done_delete, (ids, token), prepare=True)
            pairs += 1
        seconds = time.perf_counter() - started
        plans = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE statement LIKE '%%WITH seen%%'"
        ).fetchone()
    return {"mode": mode or "default", "us_per_claim_and_settle": seconds * 1e6 / max(pairs, 1),
            "generic_plans": plans[0] if plans else None,
            "custom_plans": plans[1] if plans else None}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--tasks", type=int, default=6000)
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "tasks_claim_plans.json")
    )
    args = ap.parse_args()
    migrate_tasks(args.dsn, table=TABLE)
    results = []
    for _ in range(args.rounds):
        for mode in (None, "force_generic_plan"):
            r = drain(args.dsn, args.tasks, args.limit, mode)
            results.append(r)
            print(f"{r['mode']:>20}: {r['us_per_claim_and_settle']:6.0f} us per claim + settle"
                  f" (generic plans {r['generic_plans']}, custom {r['custom_plans']})")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
