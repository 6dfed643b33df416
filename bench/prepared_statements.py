"""What running without server-side prepared statements costs (behind PgBouncer < 1.21).

A transaction pooler that keeps no prepared statements makes outboxkit parse every
statement (psycopg's ``prepare_threshold=None``; ``transaction()`` sends its INSERT
unnamed). Measured on PostgreSQL itself, so only that difference is in the figures:

* the relay's database side (claim + settle, a publisher that confirms at once) draining N
  events, with prepared statements (the default) and with ``?pooler=transaction``;
  alternating runs, the median of each;
* ``Outbox.transaction()`` on a small business transaction (an INSERT of the caller's, one
  event, the COMMIT), on a default psycopg connection and one with
  ``prepare_threshold=None``; interleaved per transaction, the median of each.

With ``--pooled-dsn`` (a DSN through PgBouncer in transaction mode) the relay is also
measured through the pooler (the pooler's own hop included).

    python bench/prepared_statements.py --dsn postgresql://postgres@127.0.0.1/bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import psycopg
from _common import make_event, prepare, reload, save, server_facts

from outboxkit import Outbox, Relay
from outboxkit.publishers.base import PublishResult


class ConfirmAtOnce:
    """A publisher whose broker confirms everything at once: the database side alone."""

    name = "confirm-at-once"

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def publish_batch(self, messages: Any) -> list[PublishResult]:
        await asyncio.sleep(0)
        return [PublishResult.success()] * len(messages)


def with_pooler(dsn: str, mode: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}pooler={mode}"


async def _drain(dsn: str, n: int) -> float:
    relay = Relay(dsn, ConfirmAtOnce(), listen=False, poll_interval=0.05, linger=0.0)
    task = asyncio.create_task(relay.run())
    started = time.perf_counter()
    while relay.stats.published < n and not task.done():  # noqa: ASYNC110 (the probe)
        await asyncio.sleep(0.002)
    seconds = time.perf_counter() - started
    relay.stop()
    await task
    return n / seconds


def relay_rates(dsn: str, n: int, runs: int, pooled: str | None) -> dict[str, Any]:
    variants = {"prepared": dsn, "unprepared": with_pooler(dsn, "transaction")}
    if pooled:
        variants["through_pgbouncer"] = with_pooler(pooled, "transaction")
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, target in variants.items():
            loaded = reload(dsn, limit=n)
            rates[name].append(asyncio.run(_drain(target, loaded)))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    ratios = {f"ratio_{k}": round(v / medians["prepared"], 3) for k, v in medians.items()}
    ratios.pop("ratio_prepared")
    return {
        "events": n,
        "runs": runs,
        "events_per_s": {k: round(v) for k, v in medians.items()},
        **ratios,
    }


def write_costs(dsn: str, rounds: int) -> dict[str, Any]:
    outbox = Outbox(notify=False)
    with (
        psycopg.connect(dsn) as prepared,
        psycopg.connect(dsn, prepare_threshold=None) as unprepared,
    ):
        prepared.execute("CREATE TABLE IF NOT EXISTS bench_tx (id bigserial PRIMARY KEY, n int)")
        prepared.commit()
        conns = {"prepared": prepared, "unprepared": unprepared}
        times: dict[str, list[float]] = {name: [] for name in conns}
        event = make_event(1)
        for i in range(rounds + 100):
            order = list(conns.items())
            random.shuffle(order)
            for name, conn in order:
                started = time.perf_counter()
                with outbox.transaction(conn) as tx:
                    conn.execute("INSERT INTO bench_tx (n) VALUES (%s)", (i,))
                    tx.put(event)
                if i >= 100:  # warm-up: statements prepared, caches filled
                    times[name].append(time.perf_counter() - started)
        prepared.execute("DROP TABLE bench_tx")
        prepared.commit()
    medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    return {
        "rounds": rounds,
        "median_us": {k: round(v, 1) for k, v in medians.items()},
        "ratio_unprepared": round(medians["unprepared"] / medians["prepared"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--pooled-dsn", help="the same database through PgBouncer (transaction)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n = 5_000 if args.quick else 50_000
    runs = 1 if args.quick else 3
    prepare(args.dsn, n)
    relay = relay_rates(args.dsn, n, runs, args.pooled_dsn)
    print(f"relay (database side): {relay}")
    write = write_costs(args.dsn, 500 if args.quick else 5_000)
    print(f"transaction() write: {write}")
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    save(
        "prepared_statements",
        {"machine": server_facts(args.dsn), "relay": relay, "transaction_write": write},
    )


if __name__ == "__main__":
    main()
