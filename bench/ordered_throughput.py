"""Ordered relay vs the unordered relay on the same events, side by side in one run.

Pre-loads N events (~300-byte JSON, 1 000 keys, written by ``Outbox.put_many``) into two
tables: ``outbox`` (plain) and ``outbox_ordered`` (``migrate --ordered``, 64 partitions),
and drains each to NATS JetStream (embedded, file store) with one relay in this process,
alternating the two several times; then 1 vs 2 ``outboxkit relay --ordered`` processes on
the ordered table (steady-state rate while 2 %..98 % drains). Target (issue 13): ordered
>= 70 % of unordered, and a second ordered process does not lower the rate.

    python bench/ordered_throughput.py --dsn postgresql://postgres@127.0.0.1/bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from _common import TOPIC, prepare, reload, save, server_facts

from outboxkit import Relay
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.publishers.nats import NatsPublisher

ORDERED = "outbox_ordered"


def _remaining(dsn: str, table: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table} WHERE status = 0").fetchone()
        return int(row[0]) if row else 0


async def _drain(dsn: str, url: str, table: str, n: int, **options: Any) -> dict[str, Any]:
    publisher = NatsPublisher.from_url(url)
    relay = Relay(dsn, publisher, table=table, listen=False, poll_interval=0.05, **options)
    t0 = time.perf_counter()
    task = asyncio.create_task(relay.run())
    while relay.stats.published < n and not task.done():  # noqa: ASYNC110 (polling is the probe)
        await asyncio.sleep(0.002)
    elapsed = time.perf_counter() - t0
    relay.stop()
    await task
    return {
        "table": table,
        "events": relay.stats.published,
        "seconds": elapsed,
        "rate": relay.stats.published / elapsed,
        "batches": relay.stats.batches,
        "options": {k: v for k, v in options.items() if k != "observer"},
    }


def _free_partitions(dsn: str) -> None:
    """No lease or membership left from an earlier run (or a killed relay)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {ORDERED}_partitions SET owner = NULL, expires_at = NULL")
        conn.execute(f"DELETE FROM {ORDERED}_relays")


def in_process(dsn: str, url: str, n: int, ordered: bool) -> dict[str, Any]:
    table = ORDERED if ordered else "outbox"
    if ordered:
        _free_partitions(dsn)
    n = reload(dsn, table=table, limit=n)
    options: dict[str, Any] = {"ordered": True} if ordered else {}
    return asyncio.run(_drain(dsn, url, table, n, **options))


def processes(dsn: str, url: str, n: int, procs: int) -> dict[str, Any]:
    """``outboxkit relay --ordered`` times procs; the steady rate while 2 %..98 % drain.

    The events are loaded once the processes divided the partitions evenly: the rate of
    a running pair, not of a hand-over (how long that took is reported).
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {ORDERED}")
    _free_partitions(dsn)
    logdir = Path(tempfile.mkdtemp(prefix="outboxkit-bench-"))
    env = {**os.environ, "OUTBOXKIT_DSN": dsn}
    command = [sys.executable, "-m", "outboxkit", "relay", "--broker", url, "--table", ORDERED]
    command += ["--ordered", "--no-listen", "--poll-interval", "0.05", "--log-level", "warning"]
    children = []
    for i in range(procs):
        log = (logdir / f"relay{i}.log").open("wb")
        children.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    samples: list[tuple[float, int]] = []
    started = time.monotonic()
    deadline = started + 600
    try:
        split = _wait_for_split(dsn, procs, deadline)
        reload(dsn, table=ORDERED, limit=n)
        while time.monotonic() < deadline:
            left = _remaining(dsn, ORDERED)
            samples.append((time.perf_counter(), left))
            if left == 0:
                break
            time.sleep(0.05)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(30)
    hi, lo = n * 0.98, n * 0.02
    start = next(s for s in samples if s[1] <= hi)
    end = next(s for s in samples if s[1] <= lo)
    rate = (start[1] - end[1]) / max(end[0] - start[0], 1e-6)
    return {
        "processes": procs,
        "events": n,
        "rate": rate,
        "window_s": end[0] - start[0],
        "split_after_s": split - started,
    }


def _wait_for_split(dsn: str, procs: int, deadline: float) -> float:
    """When every process holds 64 / procs partitions (monotonic time)."""
    while time.monotonic() < deadline:
        with psycopg.connect(dsn, autocommit=True) as conn:
            held = [
                n
                for (n,) in conn.execute(
                    f"SELECT count(*) FROM {ORDERED}_partitions"
                    " WHERE owner IS NOT NULL AND expires_at > now() GROUP BY owner"
                )
            ]
        if len(held) == procs and sum(held) == 64 and max(held) - min(held) <= 1:
            return time.monotonic()
        time.sleep(0.1)
    raise RuntimeError("the relays did not divide the partitions")


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["rate"] for r in runs]
    median = statistics.median(rates)
    return {"runs": [round(x) for x in rates], "best": max(rates), "median": median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("OUTBOXKIT_BENCH_DSN"), required=False)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="20 000 events, 1 round")
    parser.add_argument(
        "--processes-only", action="store_true", help="only 1 vs 2 ordered relay processes"
    )
    args = parser.parse_args()
    if not args.dsn:
        parser.error("give --dsn or OUTBOXKIT_BENCH_DSN (a database of its own: it is emptied)")
    n, rounds = (20_000, 1) if args.quick else (args.events, args.rounds)
    from outboxkit.testing import EmbeddedNats

    print(f"preparing {n} events (1 000 keys)...")
    prepare(args.dsn, n)
    migrate(args.dsn, table=ORDERED, ordered=True, partitions=64)
    with EmbeddedNats() as server:
        url = f"{server.url}?stream=BENCH&subjects={TOPIC.split('.')[0]}.>"
        unordered: list[dict[str, Any]] = []
        ordered: list[dict[str, Any]] = []
        for _ in range(0 if args.processes_only else rounds):  # alternated: noise hits both
            unordered.append(in_process(args.dsn, url, n, ordered=False))
            print(f"unordered relay: {unordered[-1]['rate']:,.0f} events/s")
            ordered.append(in_process(args.dsn, url, n, ordered=True))
            print(f"ordered relay:   {ordered[-1]['rate']:,.0f} events/s")
        procs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
        for _ in range(rounds):
            for k in (1, 2):
                procs[k].append(processes(args.dsn, url, n, k))
                last = procs[k][-1]
                print(
                    f"ordered, {k} process(es): {last['rate']:,.0f} events/s"
                    f" (partitions divided {last['split_after_s']:.1f}s after start)"
                )
    if args.processes_only:
        p1, p2 = summary(procs[1]), summary(procs[2])
        save(
            "ordered_processes",
            {
                "events": n,
                "ordered_processes_1": p1,
                "ordered_processes_2": p2,
                "two_over_one_process_median": p2["median"] / p1["median"],
                "machine": server_facts(args.dsn),
                "command": " ".join(["python", *sys.argv]),
                "raw": procs,
            },
        )
        print(f"2 / 1 ordered processes: {p2['median'] / p1['median']:.0%}")
        return
    u, o = summary(unordered), summary(ordered)
    p1, p2 = summary(procs[1]), summary(procs[2])
    result = {
        "events": n,
        "keys": 1000,
        "partitions": 64,
        "broker": "nats (embedded, JetStream file store)",
        "unordered": u,
        "ordered": o,
        "ordered_over_unordered_median": o["median"] / u["median"],
        "ordered_over_unordered_best": o["best"] / u["best"],
        "ordered_processes_1": p1,
        "ordered_processes_2": p2,
        "two_over_one_process_median": p2["median"] / p1["median"],
        "machine": server_facts(args.dsn),
        "command": " ".join(["python", *sys.argv]),
        "raw": {"unordered": unordered, "ordered": ordered, "processes": procs},
    }
    print(
        f"ordered / unordered: {result['ordered_over_unordered_median']:.0%} (median),"
        f" 2 / 1 ordered processes: {result['two_over_one_process_median']:.0%}"
    )
    save("ordered_throughput", result)


if __name__ == "__main__":
    main()
