"""Relay memory with a large backlog, then the claim's plan at 1 M published rows (keep mode).

1. Loads a backlog of 1 000 000 pending events (200 000 in --quick), starts one
   ``outboxkit relay --retention keep`` process to Kafka (Tansu) and samples its
   RSS every 0.25 s until the backlog is drained: the relay must never hold more
   than its in-flight window (target <= 200 MB).
2. The table now holds the drained events as published rows (keep mode); with a
   few pending rows added, ``EXPLAIN (ANALYZE, BUFFERS)`` of the relay's claim
   statement (rolled back) must use the pending partial index and touch only a
   handful of buffers, not the published rows.

    python bench/memory_and_plan.py --dsn postgresql://postgres@127.0.0.1/bench [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import psycopg
from _common import TOPIC, ensure_topic, kafka_broker, prepare, remaining, save, server_facts

from outboxkit.backends.postgres.postgres import Statements
from outboxkit.testing import spawn_relay

_COLUMNS = "event_id, topic, key, event_type, aggregate_type, aggregate_id, payload, headers"


def load_backlog(dsn: str, total: int) -> int:
    """``total`` pending rows: the seed, repeated, with fresh event ids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        seed = conn.execute("SELECT count(*) FROM bench_seed").fetchone()
        per = int(seed[0]) if seed else 0
        loaded = 0
        while loaded < total:
            cols = _COLUMNS.replace("event_id", "gen_random_uuid()")
            cur = conn.execute(
                f"INSERT INTO outbox ({_COLUMNS}) SELECT {cols} FROM bench_seed LIMIT %s",
                (min(per, total - loaded),),
            )
            loaded += cur.rowcount
        conn.execute("VACUUM ANALYZE outbox")
        conn.execute("CHECKPOINT")
        return loaded


def drain_with_rss(dsn: str, bootstrap: str, total: int) -> dict[str, Any]:
    logdir = Path(tempfile.mkdtemp(prefix="outboxkit-mem-"))
    proc = spawn_relay(
        dsn,
        f"kafka://{bootstrap}",
        logdir / "relay.log",
        "--retention",
        "keep",
        "--no-listen",
        "--poll-interval",
        "0.1",
        log_level="warning",
    )
    ps = psutil.Process(proc.pid)
    rss: list[tuple[float, float]] = []
    t0 = time.monotonic()
    last_check = 0.0
    left = total
    try:
        while time.monotonic() - t0 < 900:
            now = time.monotonic() - t0
            rss.append((now, ps.memory_info().rss / 1e6))
            if now - last_check >= 2.0:
                left = remaining(dsn)
                last_check = now
                if left == 0:
                    break
            time.sleep(0.25)
    finally:
        proc.terminate()
        proc.wait(30)
    elapsed = time.monotonic() - t0
    return {
        "backlog": total,
        "left": left,
        "seconds": elapsed,
        "rate": (total - left) / elapsed,
        "rss_max_mb": max(r for _, r in rss),
        "rss_start_mb": rss[0][1],
        "rss_samples": [(round(t, 2), round(r, 1)) for t, r in rss[::8]],
    }


def claim_plan(dsn: str, pending: int) -> dict[str, Any]:
    stmts = Statements("outbox")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO outbox ({_COLUMNS}) SELECT gen_random_uuid(), topic, key, event_type,"
            f" aggregate_type, aggregate_id, payload, headers FROM bench_seed LIMIT %s",
            (pending,),
        )
        conn.execute("VACUUM ANALYZE outbox")
        counts = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 1), count(*) FILTER (WHERE status = 0)"
            " FROM outbox"
        ).fetchone()
        params = {
            "lease": 30.0,
            "token": uuid.uuid4(),
            "relay_id": "explain",
            "limit": 500,
            "max_attempts": 10,
            "commit": "off",
        }
        with conn.transaction(force_rollback=True):
            # Render the statement with its parameters bound, then EXPLAIN it.
            query = psycopg.ClientCursor(conn).mogrify(stmts.claim_batch, params)
            plan_rows = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS) {query}").fetchall()
    plan = "\n".join(r[0] for r in plan_rows)
    seq_scan = "Seq Scan" in plan
    uses_index = "outbox_pending_idx" in plan
    return {
        "published_rows": counts[0] if counts else None,
        "pending_rows": counts[1] if counts else None,
        "plan": plan,
        "seq_scan": seq_scan,
        "uses_pending_index": uses_index,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--backlog", type=int, default=1_000_000)
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    ap.add_argument("--quick", action="store_true", help="200 000-event backlog")
    args = ap.parse_args()
    total = 200_000 if args.quick else args.backlog

    prepare(args.dsn, min(total, 200_000))
    loaded = load_backlog(args.dsn, total)
    print(f"backlog of {loaded} pending events loaded")
    results: dict[str, Any] = {"machine": server_facts(args.dsn)}
    with kafka_broker(args.kafka) as bootstrap:
        ensure_topic(bootstrap, TOPIC)
        results["memory"] = drain_with_rss(args.dsn, bootstrap, loaded)
    results["claim_plan"] = claim_plan(args.dsn, 1000)
    m, p = results["memory"], results["claim_plan"]
    print(
        f"\nrelay RSS with a {loaded:,}-event backlog: max {m['rss_max_mb']:.0f} MB"
        f" (start {m['rss_start_mb']:.0f} MB; target <= 200 MB); drained at {m['rate']:,.0f}/s"
    )
    print(
        f"claim plan at {p['published_rows']:,} published + {p['pending_rows']:,} pending rows:"
        f" pending index {'yes' if p['uses_pending_index'] else 'NO'},"
        f" seq scan {'YES' if p['seq_scan'] else 'no'}"
    )
    print(p["plan"])
    save("memory_and_plan", results)


if __name__ == "__main__":
    main()
