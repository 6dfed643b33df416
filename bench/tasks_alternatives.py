"""Task mode against pgqueuer and procrastinate: no-op tasks drained by one worker process.

Pre-loads N no-op jobs, runs one worker until all ran, and reports tasks/s from the first
handler start to the last handler end (the measure of bench/tasks_throughput.py). pgqueuer
(``pip install pgqueuer``, the ``bench`` extra) runs its ``QueueManager`` in drain mode on
an asyncpg connection, at each batch size of ``--pgq-batch`` (its best is reported);
procrastinate (``pip install procrastinate``) its worker with ``wait=False`` (it returns once
the queue is empty) at each ``--procrastinate-concurrency``.

    python bench/tasks_alternatives.py --dsn postgresql://postgres@127.0.0.1/bench [--tasks 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from tasks_throughput import drain as outboxkit_drain  # type: ignore[import-not-found]


class _Span:
    """First handler start to last handler end, and how many ran."""

    def __init__(self) -> None:
        self.first = 0.0
        self.last = 0.0
        self.done = 0

    def start(self) -> None:
        if self.done == 0 and self.first == 0.0:
            self.first = time.perf_counter()

    def end(self) -> None:
        self.done += 1
        self.last = time.perf_counter()

    def rate(self) -> float:
        return self.done / (self.last - self.first)


async def _pgqueuer(dsn: str, count: int, batch_size: int) -> float:
    import asyncpg
    from pgqueuer.core.qm import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    conn = await asyncpg.connect(dsn)
    queries = Queries(AsyncpgDriver(conn))
    with contextlib.suppress(Exception):  # installed by an earlier run
        await queries.install()
    await conn.execute("TRUNCATE pgqueuer, pgqueuer_log")
    step = 5000
    for start in range(0, count, step):
        n = min(step, count - start)
        await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
    await conn.execute("VACUUM ANALYZE pgqueuer")
    span = _Span()
    qm = QueueManager(queries)

    @qm.entrypoint("noop")
    async def noop(job: Any) -> None:
        span.start()
        span.end()

    await qm.run(batch_size=batch_size, mode=QueueExecutionMode.drain)
    await conn.close()
    assert span.done == count, (span.done, count)
    return span.rate()


async def _procrastinate(dsn: str, count: int, concurrency: int) -> float:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
    span = _Span()

    @app.task(name="noop")
    async def noop() -> None:
        span.start()
        span.end()

    async with app.open_async():
        with contextlib.suppress(Exception):  # applied by an earlier run
            await app.schema_manager.apply_schema_async()
        await app.connector.execute_query_async(query="TRUNCATE procrastinate_jobs CASCADE")
        step = 5000
        for start in range(0, count, step):
            await noop.batch_defer_async(*({} for _ in range(min(step, count - start))))
        # wait=False: the worker returns once the queue is empty.
        await app.run_worker_async(concurrency=concurrency, wait=False)
    assert span.done == count, (span.done, count)
    return span.rate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--tasks", type=int, default=50_000)
    parser.add_argument("--pgq-batch", type=int, nargs="*", default=[10, 100])
    parser.add_argument("--procrastinate-concurrency", type=int, nargs="*", default=[10, 100])
    parser.add_argument("--ok", nargs=2, type=int, action="append", metavar=("CONC", "BATCH"))
    parser.add_argument("--out", default="bench/results/tasks_alternatives.json")
    args = parser.parse_args()
    from outboxkit.tasks import migrate_tasks

    migrate_tasks(args.dsn)
    results: list[dict[str, Any]] = []
    for concurrency, batch in args.ok or [(10, 1), (100, 1), (400, 200)]:
        rate = outboxkit_drain(args.dsn, args.tasks, concurrency, batch)
        results.append({"queue": "outboxkit", "concurrency": concurrency, "batch": batch,
                        "tasks_per_s": rate})  # fmt: skip
        print(f"outboxkit concurrency {concurrency} batch {batch}: {rate:,.0f} tasks/s")
    for batch in args.pgq_batch:
        rate = asyncio.run(_pgqueuer(args.dsn, args.tasks, batch))
        results.append({"queue": "pgqueuer", "batch": batch, "tasks_per_s": rate})
        print(f"pgqueuer batch {batch}: {rate:,.0f} tasks/s")
    for concurrency in args.procrastinate_concurrency:
        rate = asyncio.run(_procrastinate(args.dsn, args.tasks, concurrency))
        results.append({"queue": "procrastinate", "concurrency": concurrency, "tasks_per_s": rate})
        print(f"procrastinate concurrency {concurrency}: {rate:,.0f} tasks/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tasks": args.tasks, "results": results}, indent=2))


if __name__ == "__main__":
    main()
