"""The no-op task app the throughput benchmark hands to each queue's own worker command.

``outboxkit worker --app tasks_app:tasks`` loads it as users load theirs; ``python
tasks_app.py pgq-managers DSN N BATCH`` runs N pgqueuer QueueManagers in one process on
uvloop (N = 1: what ``pgq run`` runs; more: pgqueuer's own drain benchmark, tools/benchmark.py).
Each handler marks its start and end; when ``OKB_TASKS`` tasks have run, the process writes
the span (first start to last end, and the process's CPU seconds over it) as JSON to
``OKB_OUT``. The span is timed inside the worker, so process start-up is not in it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from outboxkit.tasks import Tasks


class _Span:
    """First handler start to last handler end, written out once ``expected`` have run."""

    def __init__(self) -> None:
        self.expected = int(os.environ.get("OKB_TASKS", "0"))
        self.out = os.environ.get("OKB_OUT", "")
        self.first = 0.0
        self.cpu_first = 0.0
        self.done = 0

    def start(self) -> None:
        if self.first == 0.0:
            self.first = time.perf_counter()
            self.cpu_first = time.process_time()

    def end(self) -> None:
        self.done += 1
        if self.done == self.expected and self.out:
            elapsed = time.perf_counter() - self.first
            cpu = time.process_time() - self.cpu_first
            result = {"done": self.done, "seconds": elapsed, "cpu_seconds": cpu}
            tmp = self.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, self.out)


span = _Span()
#: The no-op app the throughput benchmarks load: its one handler, as a user's no-op app.
tasks = Tasks()
#: bench/tasks_fairness.py's app (``tasks_app:fairness_tasks``), apart: a fair name's claim
#: beside a queue of no-op tasks is not what the throughput benchmarks measure.
fairness_tasks = Tasks()
#: bench/fleet_idle.py --worker's app (``tasks_app:idle_tasks``): each task's enqueue -> start
#: latency (its payload's stamp, taken just before the enqueue's COMMIT) appended to the file
#: ``OKB_STARTS`` names, a line per task.
idle_tasks = Tasks()


@idle_tasks.handler("stamp")
def stamp(payload: dict[str, float]) -> None:
    with open(os.environ["OKB_STARTS"], "a") as f:
        f.write(f"{time.time() - payload['stamp']}\n")


@tasks.handler("noop")
async def noop(payload: None) -> None:
    span.start()
    span.end()


_WAITS: Any = None  # bench/tasks_fairness.py: the light key's waits, one connection


async def _flood_or_light(payload: Any, ctx: Any) -> None:
    """A flood's task does nothing; a light key's (``at``: the database's clock just before
    its enqueue's COMMIT) records its wait, from then to this start, by the same clock."""
    global _WAITS
    if not payload:
        return
    import psycopg

    if _WAITS is None:
        _WAITS = await psycopg.AsyncConnection.connect(os.environ["OKB_DSN"], autocommit=True)
    await _WAITS.execute(
        "INSERT INTO bench_light_waits (run, wait) VALUES"
        " (%s, extract(epoch FROM clock_timestamp())::float8 - %s)",
        (payload["run"], float(payload["at"])),
    )


@fairness_tasks.handler("fairness.fair", fair=True)
async def fairness_fair(payload: Any, ctx: Any) -> None:
    """bench/tasks_fairness.py: a fair name's flood and light key."""
    await _flood_or_light(payload, ctx)


@fairness_tasks.handler("fairness.plain")
async def fairness_plain(payload: Any, ctx: Any) -> None:
    """bench/tasks_fairness.py: the same without fair= (the flood without a key, or serial)."""
    await _flood_or_light(payload, ctx)


async def _pgq_noop(job: Any) -> None:
    span.start()
    span.end()


async def _pgq_managers(dsn: str, managers: int, batch_size: int) -> None:
    """Several QueueManagers, one connection each, in this one process, drained."""
    import asyncpg
    from pgqueuer.core.qm import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    # OKB_PGQ_NOSYNC: its commits do not wait for the WAL flush either (as outboxkit's
    # worker statements; a user can set it per role): a loss in a crash means a re-run.
    settings = {"synchronous_commit": "off"} if os.environ.get("OKB_PGQ_NOSYNC") else {}
    conns = [await asyncpg.connect(dsn, server_settings=settings) for _ in range(managers)]
    qms = [QueueManager(Queries(AsyncpgDriver(c))) for c in conns]
    for qm in qms:
        qm.entrypoint("noop")(_pgq_noop)
    await asyncio.gather(
        *(qm.run(batch_size=batch_size, mode=QueueExecutionMode.drain) for qm in qms)
    )
    for c in conns:
        await c.close()


if __name__ == "__main__":
    # python tasks_app.py pgq-managers DSN MANAGERS BATCH (uvloop, as pgq's CLI and benchmark)
    import uvloop

    _, _, dsn_arg, managers_arg, batch_arg = sys.argv
    uvloop.run(_pgq_managers(dsn_arg, int(managers_arg), int(batch_arg)))
