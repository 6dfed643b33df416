"""Task mode latency: commit of the enqueue to the start of its handler, at a steady rate.

One worker (wake-up gate and LISTEN on, poll as the net); a writer enqueues one task per
transaction at ``--rate`` tasks/s for ``--seconds``; each payload carries its commit time.
Prints p50 / p90 / p99 in milliseconds and writes JSON.

    python bench/tasks_latency.py --dsn postgresql://postgres@127.0.0.1/bench [--rate 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import psycopg

from outboxkit.tasks import Tasks, Worker, migrate_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--linger", type=float, default=0.03)
    parser.add_argument("--out", default="bench/results/tasks_latency.json")
    args = parser.parse_args()
    migrate_tasks(args.dsn)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outboxkit_tasks")
    tasks = Tasks()
    latencies: list[float] = []
    expected = [0]
    all_in = asyncio.Event()

    @tasks.handler("ping")
    async def ping(payload: float) -> None:
        latencies.append(time.time() - payload)
        if len(latencies) == expected[0]:
            all_in.set()

    # Each payload is its enqueue time, just before the COMMIT.
    async def writer_timed() -> int:
        sent = 0
        interval = 1.0 / args.rate
        async with await psycopg.AsyncConnection.connect(args.dsn) as conn:
            start = time.perf_counter()
            while time.perf_counter() - start < args.seconds:
                async with conn.transaction():
                    await tasks.aenqueue(conn, "ping", time.time())
                sent += 1
                await asyncio.sleep(max(0.0, start + sent * interval - time.perf_counter()))
        return sent

    async def run() -> int:
        worker = Worker(tasks, args.dsn, concurrency=10, linger=args.linger)
        running = asyncio.create_task(worker.run())
        await asyncio.sleep(1.0)
        sent = await writer_timed()
        expected[0] = sent
        if len(latencies) < sent:
            await all_in.wait()
        worker.stop()
        await running
        return sent

    sent = asyncio.run(run())
    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=100)
    result = {"rate": args.rate, "tasks": sent, "p50_ms": q[49], "p90_ms": q[89], "p99_ms": q[98]}
    print(json.dumps(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
