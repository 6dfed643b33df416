"""Write overhead: the reference business transaction with and without the outbox write.

Variants are interleaved per transaction in a fresh random order each round,
with an A/A control (the plain transaction against itself) so the machine's
noise is visible next to the effect. Prints a table and writes JSON.

    python bench/write_overhead.py --dsn postgresql://postgres@127.0.0.1/bench --rounds 3000
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from outboxkit import Event, Outbox
from outboxkit.store.migrate import migrate

SCHEMA = """
DROP TABLE IF EXISTS bench_order_lines, bench_orders, bench_stock;
CREATE TABLE bench_orders (id bigserial PRIMARY KEY, customer text NOT NULL,
                           total_cents int NOT NULL, created_at timestamptz DEFAULT now());
CREATE TABLE bench_order_lines (id bigserial PRIMARY KEY, order_id bigint NOT NULL,
                                sku int NOT NULL, qty int NOT NULL);
CREATE TABLE bench_stock (sku int PRIMARY KEY, qty int NOT NULL);
INSERT INTO bench_stock SELECT g, 1000000000 FROM generate_series(1, 1000) g;
"""


def business(conn: psycopg.Connection[Any], rng: random.Random) -> int:
    order_id = conn.execute(
        "INSERT INTO bench_orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
        (f"customer-{rng.randrange(1000)}", rng.randrange(100, 100000)),
    ).fetchone()[0]  # type: ignore[index]
    skus = rng.sample(range(1, 1001), 3)
    for sku in skus:
        conn.execute(
            "INSERT INTO bench_order_lines (order_id, sku, qty) VALUES (%s, %s, %s)",
            (order_id, sku, 1),
        )
    for sku in sorted(skus):
        conn.execute("UPDATE bench_stock SET qty = qty - 1 WHERE sku = %s", (sku,))
    return int(order_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--out", default="bench/results/write_overhead.json")
    args = ap.parse_args()

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("DROP TABLE IF EXISTS outbox, outboxkit_schema_versions")
    migrate(args.dsn)
    rng = random.Random(7)
    with_notify, without_notify = Outbox(), Outbox(notify=False)
    payload = {"order": 1, "customer": "customer-1", "lines": [1, 2, 3], "total_cents": 4200}

    def plain(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            business(conn, rng)

    def outbox(ob: Outbox) -> Callable[[psycopg.Connection[Any]], None]:
        def run(conn: psycopg.Connection[Any]) -> None:
            with conn.transaction():
                order_id = business(conn, rng)
                ob.put(
                    conn,
                    Event(
                        topic="orders",
                        event_type="order.placed",
                        key=str(order_id),
                        payload=payload,
                    ),
                )

        return run

    variants: dict[str, Callable[[psycopg.Connection[Any]], None]] = {
        "plain (A)": plain,
        "plain (A/A control)": plain,
        "outbox, notify off": outbox(without_notify),
        "outbox, notify on": outbox(with_notify),
    }
    timings: dict[str, list[float]] = {k: [] for k in variants}
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        for _ in range(200):  # warm-up: prepared statements, caches
            for fn in variants.values():
                fn(conn)
        for _ in range(args.rounds):
            order = list(variants.items())
            rng.shuffle(order)
            for name, fn in order:
                t0 = time.perf_counter_ns()
                fn(conn)
                timings[name].append((time.perf_counter_ns() - t0) / 1e6)
        server = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]

    base = statistics.median(timings["plain (A)"])
    results = []
    print(f"{'variant':<24} {'median ms':>10} {'p99 ms':>8} {'vs plain':>9}")
    for name, xs in timings.items():
        xs.sort()
        med = statistics.median(xs)
        p99 = xs[int(len(xs) * 0.99) - 1]
        delta = (med / base - 1) * 100
        results.append({"variant": name, "median_ms": med, "p99_ms": p99, "overhead_pct": delta})
        print(f"{name:<24} {med:>10.3f} {p99:>8.3f} {delta:>+8.1f}%")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "write_overhead",
                "rounds": args.rounds,
                "server_version": server,
                "machine": {
                    "cpus": __import__("os").cpu_count(),
                    "python": platform.python_version(),
                },
                "date": time.strftime("%Y-%m-%d"),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
