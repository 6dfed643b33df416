"""Run every benchmark against servers started from wheels; JSON lands in bench/results/.

    make bench                       # embedded PostgreSQL 18, fsync on (~25 min)
    make bench ARGS=--quick          # smoke run of every benchmark (a few minutes)
    python bench/run_all.py --only relay_throughput latency
    python bench/run_all.py --dsn postgresql://postgres@127.0.0.1/postgres   # your server

Each benchmark is its own script (run one alone with ``--help``); this runner
only provides a server and a scratch database for each.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

from outboxkit.testing import EmbeddedPostgres

HERE = Path(__file__).parent
BENCHMARKS: list[tuple[str, list[str]]] = [
    ("write_overhead.py", []),  # rounds: OUTBOXKIT_BENCH_WRITE_ROUNDS (default 3000)
    ("write_profile.py", []),  # where the write's microseconds go
    ("write_row_cost.py", []),  # what one event row costs, per table option
    ("write_ab.py", []),  # the write against its floors and a naive INSERT, one run
    ("concurrent_writers.py", []),  # 1..64 writers: throughput kept, wait events
    ("relay_throughput.py", []),
    ("alternatives.py", []),
    ("latency.py", []),
    ("memory_and_plan.py", []),
    ("table_health.py", []),
]
# Every benchmark takes --quick: a smoke run of a few minutes in all, whose results go to
# *.quick.json so the committed figures stay those of the last full run.
QUICK_CAPABLE = {
    "write_overhead.py",
    "write_profile.py",
    "write_row_cost.py",
    "write_ab.py",
    "concurrent_writers.py",
    "relay_throughput.py",
    "alternatives.py",
    "latency.py",
    "memory_and_plan.py",
    "table_health.py",
}


def _with_db(admin_dsn: str, name: str) -> str:
    return psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", help="admin DSN of a PostgreSQL to use instead of an embedded one")
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, short durations")
    ap.add_argument("--only", nargs="+", metavar="SCRIPT", help="run only these scripts")
    args = ap.parse_args()

    server = None
    admin_dsn = args.dsn
    if admin_dsn is None:
        # fsync stays on: commit latency is what the write benchmark measures.
        server = EmbeddedPostgres(fsync=True)
        server.start()
        admin_dsn = server.dsn
    failed = 0
    try:
        for script, extra in BENCHMARKS:
            if (
                args.only
                and script not in args.only
                and script.removesuffix(".py") not in args.only
            ):
                continue
            if args.quick and script in QUICK_CAPABLE:
                extra = [*extra, "--quick"]
            db = f"outboxkit_bench_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
            try:
                print(f"\n== {script}", flush=True)
                cmd = [sys.executable, str(HERE / script), "--dsn", _with_db(admin_dsn, db), *extra]
                failed += subprocess.run(cmd, check=False).returncode != 0
            finally:
                with psycopg.connect(admin_dsn, autocommit=True) as conn:
                    conn.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                            sql.Identifier(db)
                        )
                    )
    finally:
        if server is not None:
            server.close()
    if not args.quick:  # a smoke run leaves the figures (and their charts) alone
        failed += (
            subprocess.run([sys.executable, str(HERE / "plots.py")], check=False).returncode != 0
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
