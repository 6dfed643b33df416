"""Task mode latency: commit of the enqueue to the start of its handler, at a steady rate.

One worker (wake-up gate and LISTEN on, poll as the net); a writer enqueues one task per
transaction at ``--rate`` tasks/s for ``--seconds``, in a process of its own as an
application would (``--writer loop``: in the worker's event loop, as before, where the
writer's CPU delays the worker's). Prints p50 / p90 / p99 in milliseconds, from the enqueue
(before the INSERT: the INSERT's and the COMMIT's round trips included) and from the COMMIT
sent, and writes JSON.

    python bench/tasks_latency.py --dsn postgresql://postgres@127.0.0.1/bench [--rate 200]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import psycopg

from outboxkit.tasks import Tasks, Worker, migrate_tasks


async def _never_here(payload: list[float]) -> None:
    raise AssertionError("the worker's process runs ping")


def _write(dsn: str, rate: float, seconds: float) -> list[float]:
    """Enqueue at ``rate``; each payload is [its number, its enqueue time]. Returns the time
    each COMMIT was sent."""
    tasks = Tasks()
    tasks.handler("ping")(_never_here)  # enqueue checks the type is known; the worker runs it
    commit_sent: list[float] = []
    interval = 1.0 / rate
    with psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            with conn.transaction():
                tasks.enqueue(conn, "ping", [len(commit_sent), time.time()])
                commit_sent.append(time.time())
            time.sleep(max(0.0, start + len(commit_sent) * interval - time.perf_counter()))
    return commit_sent


async def _write_in_loop(tasks: Tasks, dsn: str, rate: float, seconds: float) -> list[float]:
    commit_sent: list[float] = []
    interval = 1.0 / rate
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            async with conn.transaction():
                await tasks.aenqueue(conn, "ping", [len(commit_sent), time.time()])
                commit_sent.append(time.time())
            await asyncio.sleep(max(0.0, start + len(commit_sent) * interval - time.perf_counter()))
    return commit_sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--linger", type=float, default=0.03)
    parser.add_argument("--writer", choices=("process", "loop"), default="process")
    parser.add_argument("--out", default="bench/results/tasks_latency.json")
    args = parser.parse_args()
    migrate_tasks(args.dsn)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outboxkit_tasks")
    tasks = Tasks()
    started: list[tuple[int, float, float]] = []  # (number, handler start, enqueue time)
    expected = [0]
    all_in = asyncio.Event()

    @tasks.handler("ping")
    async def ping(payload: list[float]) -> None:
        started.append((int(payload[0]), time.time(), payload[1]))
        if len(started) == expected[0]:
            all_in.set()

    async def run() -> list[float]:
        worker = Worker(tasks, args.dsn, concurrency=10, linger=args.linger)
        running = asyncio.create_task(worker.run())
        await asyncio.sleep(1.0)
        if args.writer == "loop":
            commit_sent = await _write_in_loop(tasks, args.dsn, args.rate, args.seconds)
        else:
            spawn = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
                commit_sent = await asyncio.get_running_loop().run_in_executor(
                    pool, _write, args.dsn, args.rate, args.seconds
                )
        expected[0] = len(commit_sent)
        if len(started) < len(commit_sent):
            await all_in.wait()
        worker.stop()
        await running
        return commit_sent

    commit_sent = asyncio.run(run())
    q = statistics.quantiles([(at - t) * 1000 for _, at, t in started], n=100)
    c = statistics.quantiles([(at - commit_sent[n]) * 1000 for n, at, _ in started], n=100)
    result = {
        "rate": args.rate,
        "linger": args.linger,
        "writer": args.writer,
        "tasks": len(commit_sent),
        "p50_ms": q[49],
        "p90_ms": q[89],
        "p99_ms": q[98],
        "from_commit_p50_ms": c[49],
        "from_commit_p90_ms": c[89],
        "from_commit_p99_ms": c[98],
    }
    print(json.dumps(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
