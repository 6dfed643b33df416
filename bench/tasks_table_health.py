"""Task mode's table health: size and claim latency under sustained load, and past a history.

Measured as the outbox's table health (bench/table_health.py): two task tables side by side
for the same minutes, one with the default retention (a finished task is deleted) and one
with ``retention="keep"`` purged every 10 s of tasks finished more than 30 s ago
(``outboxkit tasks purge``'s function). Per table a writer process enqueues one no-op task
per transaction at ``--rate`` and a worker process (``Worker``, the library's defaults but
the retention) runs them. Every 5 s the sampler records each table's total size (heap +
indexes + TOAST), heap and per-index sizes, its live tasks and rows, what vacuum sees
(``pg_stat_user_tables``: tasks inserted, dead tuples, updates and HOT updates, autovacuum
runs; a vacuum in progress) and the latency of the worker's claim statement (run in a
transaction that is rolled back). ``--compare`` adds the same two tables with
``autovacuum_enabled = false`` (what a server with ``autovacuum = off`` does to every table),
in the same run. Then the history part: ``--history`` finished tasks are added to the kept
table and the claim's latency is compared with the table that has none (both holding the
same 50 queued tasks; ``--history 0`` skips it). Writes JSON.

    python bench/tasks_table_health.py --embedded --rate 500 --seconds 600 --compare
    python bench/tasks_table_health.py --dsn postgresql://postgres@127.0.0.1/bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import multiprocessing
import os
import statistics
import time
import uuid
from typing import Any

import psycopg
from _common import save, server_facts

from outboxkit.backends.postgres.tasks_pg import purge_finished
from outboxkit.backends.postgres.tasks_sql import TaskStatements
from outboxkit.queue.tasks import TaskStatus
from outboxkit.tasks import Tasks, Worker, migrate_tasks

TABLES = {"delete": "outboxkit_tasks", "keep": "outboxkit_tasks_keep"}
#: --compare: the same two retentions on tables autovacuum never visits (the table's
#: autovacuum_enabled = false, as a server with autovacuum = off treats every table)
UNVACUUMED = {"delete_novacuum": "outboxkit_tasks_nv", "keep_novacuum": "outboxkit_tasks_keep_nv"}


def _tasks(table: str) -> Tasks:
    tasks = Tasks(table=table)

    @tasks.handler("noop")
    async def noop(payload: None) -> None:
        return None

    return tasks


def writer(dsn: str, table: str, rate: float, seconds: float) -> None:
    """One no-op task per transaction at ``rate`` a second, for ``seconds``."""
    tasks = _tasks(table)
    with psycopg.connect(dsn) as conn:
        t0 = time.perf_counter()
        i = 0
        while time.perf_counter() - t0 < seconds:
            due = t0 + i / rate
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            with conn.transaction():
                tasks.enqueue(conn, "noop", None)
            i += 1


def worker(dsn: str, table: str, retention: str, seconds: float) -> None:
    async def main() -> None:
        w = Worker(_tasks(table), dsn, retention=retention)  # type: ignore[arg-type]
        running = asyncio.create_task(w.run())
        await asyncio.sleep(seconds)
        w.stop()
        await running

    asyncio.run(main())


def claim_ms(conn: psycopg.Connection[Any], table: str) -> float:
    """One claim of up to 10 tasks (the default worker asks for fewer), rolled back."""
    params = {"limit": 10, "lease": 30.0, "token": uuid.uuid4(), "owner": "probe",
              "max_attempts": 5, "queue": "default"}  # fmt: skip
    t = time.perf_counter()
    with conn.transaction(force_rollback=True):
        conn.execute(TaskStatements(table).claim, params).fetchall()
    return (time.perf_counter() - t) * 1000


# Why a table grows: its dead tuples, how many updates were HOT (no new index entries),
# how often autovacuum ran, and which part (heap or an index) holds the bytes.
_STATS = """
SELECT pg_total_relation_size(c.oid), pg_relation_size(c.oid), pg_indexes_size(c.oid),
       s.n_tup_ins, s.n_dead_tup, s.n_tup_upd, s.n_tup_hot_upd, s.autovacuum_count,
       (SELECT coalesce(max(p.phase), '') FROM pg_stat_progress_vacuum AS p
        WHERE p.relid = c.oid),
       (SELECT jsonb_object_agg(i.indexrelid::regclass::text,
                                round(pg_relation_size(i.indexrelid) / 1e6, 3))
        FROM pg_index AS i WHERE i.indrelid = c.oid)
FROM pg_class AS c JOIN pg_stat_user_tables AS s ON s.relid = c.oid
WHERE c.oid = %s::regclass
"""


def sample(conn: psycopg.Connection[Any], table: str) -> dict[str, Any]:
    row = conn.execute(_STATS, (table,)).fetchone()
    assert row is not None
    size, heap, indexes, inserted, dead, upd, hot, autovacuums, vacuuming, per_index = row
    live, rows = conn.execute(
        f"SELECT (SELECT count(*) FROM {table} WHERE status < {int(TaskStatus.DONE)}),"
        f" (SELECT count(*) FROM {table})"
    ).fetchone() or (0, 0)
    return {
        "size_mb": size / 1e6,
        "heap_mb": heap / 1e6,
        "indexes_mb": indexes / 1e6,
        "index_mb": per_index,
        "live": live,
        "rows": rows,
        "inserted": inserted,
        "dead_tuples": dead,
        "updates": upd,
        "hot_updates": hot,
        "autovacuums": autovacuums,
        "vacuum_phase": vacuuming,
        "claim_ms": claim_ms(conn, table),
    }


def sustained(
    dsn: str, tables: dict[str, str], rate: float, seconds: float
) -> dict[str, list[dict[str, Any]]]:
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=target, args=args)
        for mode, table in tables.items()
        for target, args in (
            (worker, (dsn, table, mode.removesuffix("_novacuum"), seconds + 10)),
            (writer, (dsn, table, rate, seconds)),
        )
    ]
    series: dict[str, list[dict[str, Any]]] = {mode: [] for mode in tables}
    for p in procs:
        p.start()
    try:
        t0 = last_purge = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.monotonic() - t0 < seconds:
                time.sleep(5.0)
                now = time.monotonic()
                if now - last_purge >= 10:
                    for mode, table in tables.items():
                        if mode.startswith("keep"):
                            purge_finished(dsn, table, older_than=30.0)
                    last_purge = now
                for mode, table in tables.items():
                    point = {"t": round(now - t0, 1), **sample(conn, table)}
                    series[mode].append(point)
                print(
                    f"{now - t0:6.0f}s  "
                    + "\n        ".join(
                        f"{m}: {s[-1]['size_mb']:.2f} MB (heap {s[-1]['heap_mb']:.1f}),"
                        f" {s[-1]['live']} live, {s[-1]['dead_tuples']} dead,"
                        f" av {s[-1]['autovacuums']}{'*' if s[-1]['vacuum_phase'] else ''},"
                        f" claim {s[-1]['claim_ms']:.2f} ms"
                        for m, s in series.items()
                    ),
                    flush=True,
                )
    finally:
        for p in procs:
            p.join(60)
    return series


def history(dsn: str, rows: int, probes: int) -> dict[str, Any]:
    """Claim latency with ``rows`` finished tasks kept beside 50 queued ones, and without."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in TABLES.values():
            conn.execute(f"TRUNCATE {table}")
        conn.execute(
            f"INSERT INTO {TABLES['keep']} (task_name, status, finished_at)"
            f" SELECT 'noop', {int(TaskStatus.DONE)}, now() FROM generate_series(1, %s)",
            (rows,),
        )
        for table in TABLES.values():
            conn.execute(
                f"INSERT INTO {table} (task_name) SELECT 'noop' FROM generate_series(1, 50)"
            )
            conn.execute(f"VACUUM ANALYZE {table}")
        out: dict[str, Any] = {}
        for mode, table in TABLES.items():
            times = sorted(claim_ms(conn, table) for _ in range(probes))
            size = conn.execute(f"SELECT pg_total_relation_size('{table}')").fetchone()
            out[mode] = {
                "history_rows": rows if mode == "keep" else 0,
                "size_mb": (size[0] if size else 0) / 1e6,
                "claim_ms_p50": statistics.median(times),
                "claim_ms_p99": times[int(len(times) * 0.99) - 1],
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", help="PostgreSQL database to use (or --embedded)")
    ap.add_argument(
        "--embedded",
        action="store_true",
        help="start an embedded PostgreSQL (outboxkit.testing, autovacuum on) instead",
    )
    ap.add_argument("--rate", type=float, default=500.0, help="tasks/s per table")
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--history", type=int, default=1_000_000, help="finished tasks kept")
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="30 s, 100 000 history rows")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also two tables autovacuum never visits (the cause, side by side in one run)",
    )
    ap.add_argument("--name", default="tasks_table_health", help="results file name")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.history = 30.0, 100_000
    with contextlib.ExitStack() as stack:
        if args.embedded:
            from outboxkit.testing import EmbeddedPostgres

            server = EmbeddedPostgres(fsync=True)
            server.start()
            stack.callback(server.close)
            args.dsn = server.dsn
        elif not args.dsn:
            ap.error("give --dsn or --embedded")
        run(args)


def run(args: argparse.Namespace) -> None:
    tables = {**TABLES, **(UNVACUUMED if args.compare else {})}
    for mode, table in tables.items():
        migrate_tasks(args.dsn, table=table)
        vacuumed = "false" if mode.endswith("_novacuum") else "true"
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = {vacuumed})")
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        for table in tables.values():
            conn.execute(f"TRUNCATE {table}")
        vacuum = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("autovacuum", "autovacuum_naptime", "autovacuum_max_workers")
        }
        options = {
            table: conn.execute(
                "SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (table,)
            ).fetchone()[0]  # type: ignore[index]
            for table in tables.values()
        }
    print("server:", vacuum, flush=True)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    series = sustained(args.dsn, tables, args.rate, args.seconds)
    load_end = os.getloadavg()
    past = history(args.dsn, args.history, args.probes) if args.history else {}
    summary = {mode: summarise(points) for mode, points in series.items()}
    for mode, facts in summary.items():
        print(f"{mode}: {facts}")
    print("past a history:", past)
    path = save(
        args.name + ("_quick" if args.quick else ""),
        {
            "started": started,
            "rate": args.rate,
            "seconds": args.seconds,
            "load_average_start_end": [load_start, load_end],
            "server": server_facts(args.dsn),
            "embedded": args.embedded,
            "vacuum_settings": vacuum,
            "table_options": options,
            "series": series,
            "summary": summary,
            "history": past,
        },
    )
    print("->", path)


def summarise(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Size at each minute, growth over the last 3 minutes, claim medians, vacuum's work."""
    if not points:
        return {}
    quarter = points[: max(1, len(points) // 4)]
    half = points[len(points) // 2 :] or points
    last3 = [p for p in points if p["t"] >= points[-1]["t"] - 180]
    first, last = points[0], points[-1]
    updates = last["updates"] - first["updates"]
    return {
        "tasks_per_s": (last["inserted"] - first["inserted"]) / ((last["t"] - first["t"]) or 1),
        "size_mb_per_minute": [
            round(p["size_mb"], 2) for p in points if int(p["t"]) // 60 != int(p["t"] - 5) // 60
        ],
        "size_mb_last": last["size_mb"],
        "size_mb_max": max(p["size_mb"] for p in points),
        "size_mb_last_3_min_min_max": [
            min(p["size_mb"] for p in last3),
            max(p["size_mb"] for p in last3),
        ],
        "size_mb_growth_last_3_min": last["size_mb"] - last3[0]["size_mb"],
        "heap_mb_last": last["heap_mb"],
        "indexes_mb_last": last["indexes_mb"],
        "live_max": max(p["live"] for p in points),
        "dead_tuples_max_second_half": max(p["dead_tuples"] for p in half),
        "autovacuums": last["autovacuums"],
        "hot_update_share": (last["hot_updates"] - first["hot_updates"]) / updates
        if updates
        else None,
        "claim_ms_median_first_quarter": statistics.median(p["claim_ms"] for p in quarter),
        "claim_ms_median_second_half": statistics.median(p["claim_ms"] for p in half),
        "claim_ms_median_last_3_min": statistics.median(p["claim_ms"] for p in last3),
    }


if __name__ == "__main__":
    main()
