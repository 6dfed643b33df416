"""Task mode against pgqueuer and procrastinate: no-op tasks drained by one worker process.

Each contender runs as users run it, in a process of its own: ``outboxkit worker --app
tasks_app:tasks``, and pgqueuer's ``QueueManager.run(mode=drain)`` on uvloop as ``pgq run``
runs it (``pgq run`` itself stops at start-up with this click version: its ``--log-level``
parser fails), one manager per asyncpg connection, or several in one process as pgqueuer's
own drain benchmark (tools/benchmark.py) does (``--pgq-managers``).
Before each run the queue is refilled with N no-op tasks and vacuumed; the measure is
first handler start to last handler end, timed inside the worker (bench/tasks_app.py), so
process start-up is not in it. ``--rounds`` repeats the whole sweep, interleaved (round 1
runs every configuration, then round 2 ...); the median of each configuration is reported.
pgqueuer's ``--pgq-durability balanced`` keeps its job table logged (only its log and
statistics tables are unlogged), so it keeps the durability outboxkit has; ``nosync``
(``--pgq`` only) keeps its tables logged and sets ``synchronous_commit=off`` on its
connections, as outboxkit's worker does for its claims and settles; ``volatile`` (nothing
logged: a crash loses the queue) is not comparable and not offered. procrastinate runs in
this process (``run_worker_async(wait=False)``), in the first round only (it is two orders
of magnitude slower), at each ``--procrastinate-concurrency``.

    cd bench && PYTHONPATH=../src:. python tasks_alternatives.py --dsn postgresql://... \\
        --ok 400 200 --pgq-batch 100 500 1000 --pgq-managers 5 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tasks_throughput import fill as fill_outboxkit  # type: ignore[import-not-found]

HERE = Path(__file__).resolve().parent


async def _pgq_install(dsn: str, durability: str) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn)
    queries = Queries(AsyncpgDriver(conn))
    with contextlib.suppress(Exception):  # installed by an earlier run
        await queries.install()
    logged = "LOGGED" if durability == "durable" else "UNLOGGED"
    for table in ("pgqueuer_log", "pgqueuer_statistics"):  # `pgq durability balanced`
        await conn.execute(f"ALTER TABLE {table} SET {logged}")
    await conn.close()


async def _pgq_fill(dsn: str, count: int) -> None:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn)
    queries = Queries(AsyncpgDriver(conn))
    await conn.execute("TRUNCATE pgqueuer, pgqueuer_log")
    step = 5000
    for start in range(0, count, step):
        n = min(step, count - start)
        await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
    await conn.execute("VACUUM ANALYZE pgqueuer")
    await conn.execute("VACUUM ANALYZE pgqueuer_log")
    await conn.close()


def _absolute_path() -> list[str]:
    """This process's PYTHONPATH made absolute (the workers run in bench/)."""
    return [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _run_process(
    argv: list[str], dsn: str, count: int, timeout: float, src: str | None = None
) -> dict[str, float]:
    """Start ``argv`` (a worker; ``src`` first on its path), wait for its span file, stop it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "span.json"
        env = {
            **os.environ,
            "OKB_TASKS": str(count),
            "OKB_OUT": str(out),
            "OKB_DSN": dsn,
            "PYTHONPATH": os.pathsep.join([*([src] if src else []), str(HERE), *_absolute_path()]),
        }
        log = Path(tmp) / "worker.log"
        with open(log, "wb") as log_file:
            child = subprocess.Popen(argv, cwd=HERE, env=env, stdout=log_file, stderr=log_file)
            deadline = time.monotonic() + timeout
            try:
                while not out.exists():
                    if child.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{' '.join(argv[:3])} ended or timed out before {count} tasks ran:"
                            f"\n{log.read_text()[-2000:]}"
                        )
                    time.sleep(0.05)
            finally:
                if child.poll() is None:
                    child.terminate()
                try:
                    child.wait(30)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
        span: dict[str, float] = json.loads(out.read_text())
    return span


def outboxkit_cli(
    dsn: str, count: int, concurrency: int, batch: int, src: str | None = None
) -> dict[str, float]:
    fill_outboxkit(dsn, count)
    argv = [sys.executable, "-m", "outboxkit", "worker", "--dsn", dsn, "--app", "tasks_app:tasks",
            "--concurrency", str(concurrency), "--batch-size", str(batch),
            "--log-level", "WARNING"]  # fmt: skip
    return _run_process(argv, dsn, count, timeout=300, src=src)


def pgq_managers(
    dsn: str, count: int, managers: int, batch: int, nosync: bool = False
) -> dict[str, float]:
    asyncio.run(_pgq_fill(dsn, count))
    os.environ["OKB_PGQ_NOSYNC"] = "1" if nosync else ""
    argv = [sys.executable, str(HERE / "tasks_app.py"), "pgq-managers", dsn, str(managers),
            str(batch)]  # fmt: skip
    return _run_process(argv, dsn, count, timeout=300)


async def _procrastinate(dsn: str, count: int, concurrency: int) -> dict[str, float]:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
    first = last = 0.0
    done = 0

    @app.task(name="noop")
    async def noop() -> None:
        nonlocal first, last, done
        if first == 0.0:
            first = time.perf_counter()
        done += 1
        last = time.perf_counter()

    async with app.open_async():
        with contextlib.suppress(Exception):  # applied by an earlier run
            await app.schema_manager.apply_schema_async()
        await app.connector.execute_query_async(query="TRUNCATE procrastinate_jobs CASCADE")
        step = 5000
        for start in range(0, count, step):
            await noop.batch_defer_async(*({} for _ in range(min(step, count - start))))
        # wait=False: the worker returns once the queue is empty.
        await app.run_worker_async(concurrency=concurrency, wait=False)
    assert done == count, (done, count)
    return {"done": done, "seconds": last - first, "cpu_seconds": float("nan")}


def _config(result: dict[str, Any]) -> str:
    shown = {k: v for k, v in result.items() if k not in _MEASURES}
    return " ".join(f"{k}={v}" for k, v in shown.items() if k != "queue")


_MEASURES = ("tasks_per_s", "runs", "cpu_us_per_task")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--tasks", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--ok", nargs=2, type=int, action="append", metavar=("CONC", "BATCH"),
        help="an `outboxkit worker --concurrency CONC --batch-size BATCH` run (repeat)",
    )  # fmt: skip
    parser.add_argument(
        "--base-src", help="A/B: also run each --ok from this src tree (e.g. `git archive` of"
        " an older commit), interleaved; its rows say src=...",
    )  # fmt: skip
    parser.add_argument("--pgq-batch", type=int, nargs="*", default=[10, 100, 500, 1000])
    parser.add_argument(
        "--pgq-managers", type=int, nargs="*", default=[1],
        help="QueueManagers in the one process (1: as `pgq run`), at each --pgq-batch",
    )  # fmt: skip
    parser.add_argument(
        "--pgq-durability", nargs="*", choices=["durable", "balanced"], default=["durable"]
    )
    parser.add_argument(
        "--pgq", nargs=3, action="append", metavar=("BATCH", "MANAGERS", "DURABILITY"),
        help="one pgqueuer configuration (repeat); replaces the --pgq-* sweep",
    )  # fmt: skip
    parser.add_argument("--procrastinate-concurrency", type=int, nargs="*", default=[100])
    parser.add_argument("--out", default=str(HERE / "results" / "tasks_alternatives.json"))
    args = parser.parse_args()
    from outboxkit.tasks import migrate_tasks

    migrate_tasks(args.dsn)
    runs: list[tuple[str, dict[str, Any], Any]] = []
    for concurrency, batch in args.ok or [(10, 1), (400, 200)]:
        for src in [None, *([str(Path(args.base_src).resolve())] if args.base_src else [])]:
            config = {"concurrency": concurrency, "batch": batch, **({"src": src} if src else {})}
            runs.append(("outboxkit", config, lambda c=concurrency, b=batch, s=src: (
                outboxkit_cli(args.dsn, args.tasks, c, b, s))))  # fmt: skip
    sweep = [
        (b, m, d) for d in args.pgq_durability for b in args.pgq_batch for m in args.pgq_managers
    ]
    for batch, managers, durability in [(int(b), int(m), d) for b, m, d in args.pgq or []] or sweep:
        if durability not in ("durable", "balanced", "nosync"):
            parser.error(f"--pgq ... {durability}: durable, balanced or nosync")
        config = {"batch": batch, "durability": durability, "managers": managers}
        tables = "balanced" if durability == "balanced" else "durable"
        runs.append(("pgqueuer", config, lambda b=batch, t=tables, m=managers, d=durability: (
            asyncio.run(_pgq_install(args.dsn, t)),
            pgq_managers(args.dsn, args.tasks, m, b, nosync=d == "nosync"))[1]))  # fmt: skip
    for concurrency in args.procrastinate_concurrency:
        runs.append(("procrastinate", {"concurrency": concurrency}, lambda c=concurrency: (
            asyncio.run(_procrastinate(args.dsn, args.tasks, c)))))  # fmt: skip
    rates: list[list[float]] = [[] for _ in runs]
    cpu: list[list[float]] = [[] for _ in runs]
    for round_no in range(1, args.rounds + 1):
        for i, (queue, config, run) in enumerate(runs):
            if queue == "procrastinate" and round_no > 1:
                continue  # ~100 x slower: once per run is enough for its ratio
            span = run()
            rates[i].append(args.tasks / span["seconds"])
            cpu[i].append(span["cpu_seconds"] * 1e6 / args.tasks)
            print(f"round {round_no} {queue} {config}: {rates[i][-1]:,.0f} tasks/s,"
                  f" {cpu[i][-1]:.0f} us CPU/task", flush=True)  # fmt: skip
    results = []
    for i, (queue, config, _run) in enumerate(runs):
        rate, per_task = statistics.median(rates[i]), statistics.median(cpu[i])
        results.append({"queue": queue, **config, "tasks_per_s": rate, "runs": rates[i],
                        "cpu_us_per_task": per_task})  # fmt: skip
    best = {
        q: max(r["tasks_per_s"] for r in results if r["queue"] == q and "src" not in r)
        for q, c, _r in runs
        if "src" not in c
    }
    print("\nmedians:")
    for r in results:
        print(f"  {r['queue']:13s} {r['tasks_per_s']:9,.0f} tasks/s"
              f" {r['cpu_us_per_task']:5.0f} us CPU/task  {_config(r)}")  # fmt: skip
    for other in ("pgqueuer", "procrastinate"):
        if "outboxkit" in best and other in best:
            print(f"outboxkit best / {other} best: {best['outboxkit'] / best[other]:.2f} x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    facts = {"tasks": args.tasks, "rounds": args.rounds, "load_before": os.getloadavg(),
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
    Path(args.out).write_text(json.dumps({**facts, "results": results}, indent=2))


if __name__ == "__main__":
    main()
