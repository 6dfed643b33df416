"""Task mode: no-op tasks drained by one worker process, first task started to last finished.

Pre-loads N no-op tasks (one INSERT ... SELECT), then runs one ``Worker`` with each
(concurrency, batch size) of the sweep and reports tasks/s. The issue's comparison with
pgqueuer and procrastinate needs them installed (``pip install pgqueuer procrastinate``);
this script measures outboxkit alone and writes JSON.

    python bench/tasks_throughput.py --dsn postgresql://postgres@127.0.0.1/bench [--tasks 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from outboxkit.tasks import Tasks, Worker, migrate_tasks

SWEEP = ((10, 1), (100, 1), (100, 10), (200, 50), (400, 200))


def fill(dsn: str, count: int) -> None:
    """An empty, vacuumed task table with ``count`` no-op tasks (one INSERT ... SELECT)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outboxkit_tasks")
        conn.execute(
            "INSERT INTO outboxkit_tasks (task_name) SELECT 'noop' FROM generate_series(1, %s)",
            (count,),
        )
        conn.execute("VACUUM ANALYZE outboxkit_tasks")


def drain(
    dsn: str,
    count: int,
    concurrency: int,
    batch_size: int,
    load: Callable[[str, int], None] = fill,
) -> float:
    """Tasks per second, first started to last finished, of ``count`` no-op tasks ``load``
    put in the table (PostgreSQL's ``fill`` by default; bench/mariadb_tasks.py gives its own)."""
    tasks = Tasks()
    done = 0
    started = 0.0
    finished = asyncio.Event()

    @tasks.handler("noop")
    async def noop(payload: None) -> None:
        nonlocal done, started
        if done == 0:
            started = time.perf_counter()
        done += 1
        if done == count:
            finished.set()

    load(dsn, count)

    async def main() -> float:
        worker = Worker(tasks, dsn, concurrency=concurrency, batch_size=batch_size)
        running = asyncio.create_task(worker.run())
        await finished.wait()
        elapsed = time.perf_counter() - started
        worker.stop()
        await running
        return count / elapsed

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--tasks", type=int, default=50_000)
    parser.add_argument("--out", default="bench/results/tasks_throughput.json")
    args = parser.parse_args()
    migrate_tasks(args.dsn)
    results = []
    for concurrency, batch_size in SWEEP:
        rate = drain(args.dsn, args.tasks, concurrency, batch_size)
        results.append({"concurrency": concurrency, "batch_size": batch_size, "tasks_per_s": rate})
        print(f"concurrency {concurrency:4d} batch {batch_size:4d}: {rate:8.0f} tasks/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tasks": args.tasks, "results": results}, indent=2))


if __name__ == "__main__":
    main()
