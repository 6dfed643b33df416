"""Task mode's table health: size and claim latency under sustained load, and past a history.

Measured as the outbox's table health (bench/table_health.py): two task tables side by side
for the same minutes, one with the default retention (a finished task is deleted) and one
with ``retention="keep"`` purged every 10 s of tasks finished more than 30 s ago
(``outboxkit tasks purge``'s function). Per table a writer process enqueues one no-op task
per transaction at ``--rate`` and a worker process (``Worker``, the library's defaults but
the retention) runs them. Every 5 s the sampler records each table's total size (heap +
indexes + TOAST), its live tasks, its rows, and the latency of the worker's claim statement
(run in a transaction that is rolled back). Then the history part: ``--history`` finished
tasks are added to the kept table and the claim's latency is compared with the table that
has none (both holding the same 50 queued tasks). Writes JSON.

    python bench/tasks_table_health.py --dsn postgresql://postgres@127.0.0.1/bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import multiprocessing
import statistics
import time
import uuid
from typing import Any

import psycopg
from _common import save, server_facts

from outboxkit.store.tasks_pg import purge_finished
from outboxkit.store.tasks_sql import TaskStatements, TaskStatus
from outboxkit.tasks import Tasks, Worker, migrate_tasks

TABLES = {"delete": "outboxkit_tasks", "keep": "outboxkit_tasks_keep"}


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


def sample(conn: psycopg.Connection[Any], table: str) -> dict[str, Any]:
    size, live, rows = conn.execute(
        f"SELECT pg_total_relation_size('{table}'),"
        f" (SELECT count(*) FROM {table} WHERE status < {int(TaskStatus.DONE)}),"
        f" (SELECT count(*) FROM {table})"
    ).fetchone() or (0, 0, 0)
    return {"size_mb": size / 1e6, "live": live, "rows": rows, "claim_ms": claim_ms(conn, table)}


def sustained(dsn: str, rate: float, seconds: float) -> dict[str, list[dict[str, Any]]]:
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=target, args=args)
        for mode, table in TABLES.items()
        for target, args in (
            (worker, (dsn, table, mode, seconds + 10)),
            (writer, (dsn, table, rate, seconds)),
        )
    ]
    series: dict[str, list[dict[str, Any]]] = {mode: [] for mode in TABLES}
    for p in procs:
        p.start()
    try:
        t0 = last_purge = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.monotonic() - t0 < seconds:
                time.sleep(5.0)
                now = time.monotonic()
                if now - last_purge >= 10:
                    purge_finished(dsn, TABLES["keep"], older_than=30.0)
                    last_purge = now
                for mode, table in TABLES.items():
                    point = {"t": round(now - t0, 1), **sample(conn, table)}
                    series[mode].append(point)
                print(
                    f"{now - t0:6.0f}s  "
                    + "  ".join(
                        f"{m}: {s[-1]['size_mb']:.2f} MB, {s[-1]['live']} live,"
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
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rate", type=float, default=500.0, help="tasks/s per table")
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--history", type=int, default=1_000_000, help="finished tasks kept")
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="30 s, 100 000 history rows")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.history = 30.0, 100_000
    for table in TABLES.values():
        migrate_tasks(args.dsn, table=table)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        for table in TABLES.values():
            conn.execute(f"TRUNCATE {table}")
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    series = sustained(args.dsn, args.rate, args.seconds)
    past = history(args.dsn, args.history, args.probes)
    summary = {}
    for mode, points in series.items():
        half = points[len(points) // 2 :] or points
        summary[mode] = {
            "size_mb_first": points[0]["size_mb"] if points else None,
            "size_mb_last": points[-1]["size_mb"] if points else None,
            "size_mb_max": max(p["size_mb"] for p in points) if points else None,
            "live_max": max(p["live"] for p in points) if points else None,
            "claim_ms_median_second_half": statistics.median(p["claim_ms"] for p in half),
        }
    print("\nsustained load:", summary)
    print("past a history:", past)
    path = save(
        "tasks_table_health" + ("_quick" if args.quick else ""),
        {
            "started": started,
            "rate": args.rate,
            "seconds": args.seconds,
            "server": server_facts(args.dsn),
            "series": series,
            "summary": summary,
            "history": past,
        },
    )
    print("->", path)


if __name__ == "__main__":
    main()
