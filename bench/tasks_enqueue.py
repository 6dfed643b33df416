"""Enqueue cost: the reference business transaction with a task enqueued, beside the outbox write.

The reference transaction of ``bench/write_overhead.py`` (insert an order, 3 order lines,
update 3 stock rows, commit; ``synchronous_commit=on``; one connection), and its machinery:
variants interleaved per transaction in a fresh random order each round, an A/A control
(the plain transaction against itself) to show the machine's noise, medians, overheads
against the plain transaction and paired bootstrap 95 % intervals. The variants:

* ``tasks.enqueue``: one statement of its own in the transaction (a round trip);
* ``tasks.transaction``: the INSERT sent with the COMMIT (no round trip of its own);
* ``outbox.put`` and ``outbox.transaction``: the outbox's two writes, in the same run.

No worker or relay waits, so the wake-up gate is closed and nothing notifies (as in a busy
system, where a worker only waits when idle). No WAL bytes (write_overhead.py's
``wal_bytes_per_tx`` reads the server's global WAL position, which other sessions move on a
shared server). Prints a table and writes
``bench/results/tasks_enqueue.json`` (``--quick``: ``tasks_enqueue.quick.json``).

    python bench/tasks_enqueue.py --dsn postgresql://postgres@127.0.0.1/bench
    python bench/tasks_enqueue.py --dsn ... --paths psycopg --rounds 10000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
from typing import Any

import psycopg
import write_overhead as wo
from _common import save

from outboxkit import Outbox
from outboxkit.backends.postgres.migrate import migrate, migrate_tasks
from outboxkit.tasks import Tasks

TASK = "order.confirm"


def task_payload(order_id: int) -> dict[str, Any]:
    """The task beside the order event: the same size of payload (write_overhead.PAYLOAD)."""
    return {**wo.PAYLOAD, "order": order_id}


def bench_tasks() -> Tasks:
    tasks = Tasks()
    tasks.handler(TASK)(lambda payload: None)  # enqueue refuses names without a handler
    return tasks


class TasksSync(wo.WritePath):
    name = "psycopg (sync)"

    def __init__(self, dsn: str, rng: random.Random) -> None:
        super().__init__(dsn, rng)
        conn = psycopg.connect(dsn, autocommit=True)
        self.conn = conn
        tasks, outbox = bench_tasks(), Outbox()

        def plain() -> None:
            with conn.transaction():
                wo.psycopg_business(conn, self.order)

        def enqueue() -> None:
            with conn.transaction():
                order_id = wo.psycopg_business(conn, self.order)
                tasks.enqueue(conn, TASK, task_payload(order_id))

        def enqueue_with_commit() -> None:
            with tasks.transaction(conn) as tx:
                tx.enqueue(TASK, task_payload(wo.psycopg_business(conn, self.order)))

        def put() -> None:
            with conn.transaction():
                outbox.put(conn, wo.order_event(wo.psycopg_business(conn, self.order)))

        def put_with_commit() -> None:
            with outbox.transaction(conn) as tx:
                tx.put(wo.order_event(wo.psycopg_business(conn, self.order)))

        self.variants = {
            "plain (A)": plain,
            "plain (A/A control)": plain,
            "tasks.enqueue": enqueue,
            "tasks.transaction (with the COMMIT)": enqueue_with_commit,
            "outbox.put": put,
            "outbox.transaction (with the COMMIT)": put_with_commit,
        }

    def close(self) -> None:
        self.conn.close()


class TasksAsync(wo.WritePath):
    name = "psycopg (async)"
    is_async = True

    async def open(self) -> None:
        conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        self.conn = conn
        tasks, outbox = bench_tasks(), Outbox()

        async def plain() -> None:
            async with conn.transaction():
                await wo.psycopg_async_business(conn, self.order)

        async def enqueue() -> None:
            async with conn.transaction():
                order_id = await wo.psycopg_async_business(conn, self.order)
                await tasks.aenqueue(conn, TASK, task_payload(order_id))

        async def enqueue_with_commit() -> None:
            async with tasks.atransaction(conn) as tx:
                tx.enqueue(TASK, task_payload(await wo.psycopg_async_business(conn, self.order)))

        async def put() -> None:
            async with conn.transaction():
                order_id = await wo.psycopg_async_business(conn, self.order)
                await outbox.aput(conn, wo.order_event(order_id))

        async def put_with_commit() -> None:
            async with outbox.atransaction(conn) as tx:
                tx.put(wo.order_event(await wo.psycopg_async_business(conn, self.order)))

        self.variants = {
            "plain (A)": plain,
            "plain (A/A control)": plain,
            "tasks.aenqueue": enqueue,
            "tasks.atransaction (with the COMMIT)": enqueue_with_commit,
            "outbox.aput": put,
            "outbox.atransaction (with the COMMIT)": put_with_commit,
        }

    async def aclose(self) -> None:
        await self.conn.close()


PATHS: dict[str, type[wo.WritePath]] = {"psycopg": TasksSync, "psycopg-async": TasksAsync}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rounds", type=int, default=5000, help="rounds per path (default 5000)")
    ap.add_argument("--paths", default="all", help="comma-separated: psycopg, psycopg-async")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="smoke run: 300 rounds")
    ap.add_argument(
        "--save-as", default="tasks_enqueue", help="results file name in bench/results/ (no .json)"
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds = min(args.rounds, 300)

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(wo.SCHEMA)
        conn.execute("DROP TABLE IF EXISTS outbox, outboxkit_tasks, outboxkit_schedules")
        conn.execute("DROP TABLE IF EXISTS outboxkit_schema_versions")
    migrate(args.dsn)
    migrate_tasks(args.dsn)

    rng = random.Random(args.seed)
    chosen = list(PATHS) if args.paths == "all" else args.paths.split(",")
    loop = asyncio.new_event_loop()
    paths = [PATHS[key](args.dsn, random.Random(rng.random())) for key in chosen]
    for path in paths:
        if path.is_async:
            loop.run_until_complete(path.open())  # type: ignore[attr-defined]

    timings, elapsed = wo.run_interleaved(paths, args.rounds, rng, loop)
    loadavg_end = os.getloadavg()
    wo.close_paths(paths, loop)

    paths.sort(key=lambda p: list(PATHS.values()).index(type(p)))
    results: list[dict[str, Any]] = []
    for path in paths:
        for row in wo.summarise(path, timings[path.name], rng, wo.BOOTSTRAP_RESAMPLES):
            row.pop("target_met", None)  # the outbox's 2 % target is not this benchmark's
            results.append(row)

    print(
        f"\n{'path':<16} {'variant':<38} {'median ms':>9} {'overhead':>9} {'95% CI':>16}"
        f" {'client CPU':>10}"
    )
    noisy = []
    for r in results:
        lo, hi = r["ci95_pct"]
        print(
            f"{r['path']:<16} {r['variant']:<38} {r['median_ms']:>9.3f}"
            f" {r['overhead_pct']:>+8.1f}% [{lo:>+6.1f}, {hi:>+6.1f}]"
            f" {r['client_cpu_extra_us']:>+8.0f}us"
        )
        if r["variant"] == "plain (A/A control)" and abs(r["overhead_pct"]) > wo.AA_TOLERANCE_PCT:
            noisy.append(r["path"])
    if noisy:
        print(f"\nA/A control beyond ±{wo.AA_TOLERANCE_PCT} % for {', '.join(noisy)}: re-run.")
    machine = wo.machine_facts()
    machine["loadavg_end"] = loadavg_end
    save(
        args.save_as,
        {
            "rounds_per_path": args.rounds,
            "elapsed_s": round(elapsed, 1),
            "noisy_paths": noisy,
            "machine": machine,
            "server": wo.server_facts(args.dsn),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
