"""The relay's claim statements from two or more src trees, their backend CPU interleaved.

Issue 42, item 1: an A/B of the claim's fixed cost that the machine's noise does not
swamp. Each variant (``NAME=SRC``: the claim SQL that src tree renders) has a session of
its own with the relay's plan settings (generic plans, ``enable_seqscan = off``); each
cycle, in a shuffled order, another session commits ``rows`` events and the variant's
session claims them, alternately with a plain claim and with the claim that carries the
previous claim's settle (what the relay runs at steady rates). Its backend's CPU per
statement comes from /proc/<pid>/schedstat (PostgreSQL on this machine); medians.

    cd bench && PYTHONPATH=../src:. python relay_claim_ab.py --dsn postgresql://.../scratch \\
        --rows 1 5 20 --variant before=/tmp/base/src --variant now=../src
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import uuid
from typing import Any

import psycopg
from _common import save, server_facts

from outboxkit.migrations import migrate

PARAMS = {"lease": 30.0, "relay_id": "bench", "limit": 1000, "max_attempts": 10, "commit": "off"}
INSERT = (
    "INSERT INTO outbox (event_id, topic, event_type, payload) SELECT gen_random_uuid(), 't',"
    " 'e', '\\x00'::bytea FROM generate_series(1, %s)"
)
RENDER = (
    "import json; from outboxkit.backends.postgres.postgres import Statements as S;"
    " s = S('outbox'); print(json.dumps([s.claim_batch, s.claim_settling_delete]))"
)


def statements(src: str) -> tuple[str, str]:
    """The plain claim and the settle-carrying claim as ``src`` renders them."""
    out = subprocess.run([sys.executable, "-c", RENDER], env={"PYTHONPATH": src},
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    plain, carried = json.loads(out)
    return plain, carried


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e3  # µs


def run(dsn: str, rows: int, cycles: int, sql: dict[str, tuple[str, str]]) -> dict[str, Any]:
    spent: dict[str, dict[str, list[float]]] = {n: {"claim": [], "carried": []} for n in sql}
    with psycopg.connect(dsn, autocommit=True) as w:
        w.execute("TRUNCATE outbox")
        w.execute("VACUUM outbox")
        sessions: dict[str, tuple[psycopg.Connection[Any], int]] = {}
        last: dict[str, tuple[int, int, uuid.UUID] | None] = dict.fromkeys(sql)
        for name in sql:
            conn = psycopg.connect(dsn, autocommit=True)
            conn.execute("SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off")
            sessions[name] = (conn, conn.info.backend_pid)
        try:
            for n in range(cycles):
                order = list(sql)
                random.shuffle(order)
                for name in order:
                    conn, pid = sessions[name]
                    cur = conn.cursor(binary=True)
                    w.execute(INSERT, [rows])
                    token = uuid.uuid4()
                    held = last[name]
                    start = _cpu(pid)
                    if held is None:
                        kind = "claim"
                        cur.execute(sql[name][0], PARAMS | {"token": token}, prepare=True)
                    else:
                        kind = "carried"
                        args = PARAMS | {"token": token, "settle_lo": held[0],
                                         "settle_hi": held[1], "settle_token": held[2]}  # fmt: skip
                        cur.execute(sql[name][1], args, prepare=True)
                    ids = [r[0] for r in cur.fetchall() if r[0] is not None]
                    used = _cpu(pid) - start
                    assert len(ids) == rows, (name, len(ids))
                    if n >= 10:  # (after psycopg prepares the statements)
                        spent[name][kind].append(used)
                    # Alternately: the next claim carries this one's settle, or it is
                    # settled here and the next claim is a plain one.
                    if kind == "carried" and n % 2:
                        last[name] = None
                        w.execute("DELETE FROM outbox WHERE claim_token = %s", [token])
                    else:
                        last[name] = (min(ids), max(ids), token)
        finally:
            for conn, _pid in sessions.values():
                conn.close()
    return {n: {k: statistics.median(v) for k, v in kinds.items()} for n, kinds in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True, help="a scratch database (its outbox is truncated)")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 5, 20])
    ap.add_argument("--cycles", type=int, default=600)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=SRC")
    args = ap.parse_args()
    migrate(args.dsn)
    sql = {}
    for spec in args.variant:
        name, _, src = spec.partition("=")
        sql[name] = statements(src)
    results = []
    for rows in args.rows:
        medians = run(args.dsn, rows, args.cycles, sql)
        results.append({"rows": rows, "cycles": args.cycles, "medians_us": medians})
        for name, m in medians.items():
            print(f"{rows:5d} rows {name:10s}: claim {m['claim']:7.1f} µs, carrying claim"
                  f" {m['carried']:7.1f} µs", flush=True)  # fmt: skip
    save("relay_claim_ab", {"server": server_facts(args.dsn), "results": results})


if __name__ == "__main__":
    main()
