"""Where the relay's database CPU goes at steady rates: one claim-and-settle cycle, by part.

Issue 42, item 1's profile. One session runs the relay's own statements (its generic
plans, ``enable_seqscan`` as its sessions set it) on a scratch table, each cycle: another
session commits ``k`` events; the claim takes them; the settle deletes them; an empty
claim and a ``SELECT 1`` follow. The session's backend CPU per statement comes from
/proc/<pid>/schedstat (nanoseconds; PostgreSQL on this machine). ``--carry`` runs the
cycle the relay runs now instead: the claim of cycle N+1 deletes cycle N's rows in the
same statement (backends/postgres/postgres.py CLAIM_SETTLING_DELETE).

    cd bench && PYTHONPATH=../src:. python relay_cycle_cost.py --dsn postgresql://.../scratch \\
        --rows 1 5 20 100 1000
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from typing import Any

import psycopg
from _common import save, server_facts

from outboxkit.backends.postgres.postgres import Statements
from outboxkit.migrations import migrate

SQL = Statements("outbox")
PARAMS = {"lease": 30.0, "relay_id": "bench", "limit": 1000, "max_attempts": 10, "commit": "off"}
INSERT = (
    "INSERT INTO outbox (event_id, topic, event_type, payload) SELECT gen_random_uuid(), 't',"
    " 'e', '\\x00'::bytea FROM generate_series(1, %s)"
)


def run(dsn: str, rows: int, cycles: int, seqscan: bool) -> dict[str, float]:
    """Backend CPU (µs) per statement kind, and per cycle both ways, over ``cycles``."""
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as w:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        if not seqscan:
            conn.execute("SET enable_seqscan = off")
        conn.execute("TRUNCATE outbox")  # (the relay's plans are made at an empty table)
        pid = conn.info.backend_pid
        cur = conn.cursor(binary=True)

        def cpu() -> float:
            with open(f"/proc/{pid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e3  # µs

        spent: dict[str, list[float]] = {"claim": [], "settle": [], "carrying claim": []}
        spent |= {"empty claim": [], "SELECT 1": []}
        last: tuple[int, int, uuid.UUID] | None = None
        for n in range(cycles * 2):
            carry = n >= cycles  # the first half separate, the second carried
            w.execute(INSERT, [rows])
            token = uuid.uuid4()
            start = cpu()
            if carry and last is not None:
                lo, hi, held = last
                args = PARAMS | {"token": token, "settle_lo": lo, "settle_hi": hi,
                                 "settle_token": held}  # fmt: skip
                cur.execute(SQL.claim_settling_delete, args)
                ids = sorted(r[0] for r in cur.fetchall() if r[0] is not None)
                spent["carrying claim"].append(cpu() - start)
            else:
                cur.execute(SQL.claim_batch, PARAMS | {"token": token})
                ids = sorted(r[0] for r in cur.fetchall())
                spent["claim"].append(cpu() - start)
                if not carry:
                    start = cpu()
                    cur.execute(SQL.settle_claim_delete, (ids[0], ids[-1], token, "off"))
                    spent["settle"].append(cpu() - start)
            last = (ids[0], ids[-1], token)
            if not carry:
                start = cpu()
                cur.execute(SQL.claim_batch, PARAMS | {"token": uuid.uuid4()})
                cur.fetchall()
                spent["empty claim"].append(cpu() - start)
                start = cpu()
                cur.execute("SELECT 1")
                spent["SELECT 1"].append(cpu() - start)
    out = {k: statistics.fmean(v) for k, v in spent.items() if v}
    out["cycle, claim + settle"] = out["claim"] + out["settle"]
    out["cycle, carried"] = out["carrying claim"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True, help="a scratch database (its outbox is truncated)")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 5, 20, 100, 1000])
    ap.add_argument("--cycles", type=int, default=600)
    ap.add_argument("--seqscan", action="store_true", help="leave enable_seqscan on (before)")
    args = ap.parse_args()
    migrate(args.dsn)
    results: list[dict[str, Any]] = []
    for rows in args.rows:
        cycles = max(50, min(args.cycles, args.cycles * 20 // rows))
        row = run(args.dsn, rows, cycles, args.seqscan)
        results.append({"rows": rows, "cycles": cycles, **row})
        both, carried = row["cycle, claim + settle"], row["cycle, carried"]
        print(f"{rows:5d} rows: claim {row['claim']:7.1f} + settle {row['settle']:6.1f} ="
              f" {both:7.1f} µs ({both / rows:6.1f} µs/event); carried {carried:7.1f} µs"
              f" ({carried / rows:6.1f} µs/event); empty claim {row['empty claim']:5.1f},"
              f" SELECT 1 {row['SELECT 1']:4.1f}", flush=True)  # fmt: skip
    save("relay_cycle_cost", {"server": server_facts(args.dsn), "seqscan": args.seqscan,
                              "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
