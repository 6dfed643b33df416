"""The relay's claim and settle, prepared, under PostgreSQL's custom and generic plans.

Fills a scratch outbox (database ``relay_plans``, dropped and made again) with N events and
drains it ``--limit`` at a time through the relay's own statements (``Statements.claim_batch``
and ``settle_claim_delete``), prepared as psycopg prepares them, once with the server's
default ``plan_cache_mode`` and once with ``force_generic_plan`` (what the relay's claim and
settle connections set), 3 interleaved rounds each; prints the median time per claim and
settle and saves the JSON. A small ``--limit`` is what a relay at a steady rate claims.

    cd bench && PYTHONPATH=../src:. python relay_claim_plans.py --dsn postgresql://.../postgres
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.postgres import Statements

HERE = Path(__file__).resolve().parent


def drain(dsn: str, mode: str | None, limit: int, events: int) -> float:
    """Microseconds per claim + settle over a drain of ``events`` events."""
    s = Statements("outbox")
    params = {"lease": 30.0, "relay_id": "bench", "limit": limit, "max_attempts": 10,
              "commit": "off"}  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        conn.execute(
            "INSERT INTO outbox (event_id, topic, event_type, payload)"
            " SELECT gen_random_uuid(), 't', 'e', '{}' FROM generate_series(1, %s)",
            (events,),
        )
        conn.execute("VACUUM ANALYZE outbox")
        if mode:
            conn.execute(f"SET plan_cache_mode = {mode}")
        pairs, started = 0, time.perf_counter()
        while True:
            token = uuid.uuid4()
            rows = conn.execute(s.claim_batch, {**params, "token": token}, prepare=True).fetchall()
            ids = sorted(r[0] for r in rows if r[-1] is None)
            if not ids:
                break
            conn.execute(s.settle_claim_delete, (ids[0], ids[-1], token, "off"), prepare=True)
            pairs += 1
    return (time.perf_counter() - started) * 1e6 / max(pairs, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True, help="a database to create the scratch one from")
    ap.add_argument("--events", type=int, default=6000)
    ap.add_argument("--limit", type=int, nargs="*", default=[2, 20])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "relay_claim_plans.json"))
    args = ap.parse_args()
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS relay_plans")
        conn.execute("CREATE DATABASE relay_plans")
    dsn = make_conninfo(**{**conninfo_to_dict(args.dsn), "dbname": "relay_plans"})
    migrate(dsn)
    results = []
    for limit in args.limit:
        times: dict[str, list[float]] = {"default": [], "force_generic_plan": []}
        for _ in range(args.rounds):
            for mode in (None, "force_generic_plan"):
                times[mode or "default"].append(drain(dsn, mode, limit, args.events))
        row = {"limit": limit, **{k: statistics.median(v) for k, v in times.items()}}
        print(f"limit {limit}: custom plans {row['default']:.0f} us, generic"
              f" {row['force_generic_plan']:.0f} us per claim + settle")  # fmt: skip
        results.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"events": args.events, "results": results}, indent=2))


if __name__ == "__main__":
    main()
