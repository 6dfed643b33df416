"""The write alone, paired: what ordered mode and the scheduled-events column cost one write.

Each variant is a transaction holding only the write (BEGIN, write, COMMIT;
``synchronous_commit=off`` so the WAL flush does not drown a few microseconds),
interleaved in a fresh random order every round on one connection; the figure is the
median of the per-round ratios to its reference, plus the mean client CPU.

* ``ordered put`` / ``put`` and ``ordered transaction()`` / ``transaction()``: the key
  lock (one event, one key drawn from 1 000).
* ``INSERT with available_at`` / ``INSERT before it``: the statement the write sends
  since scheduled events (one more parameter, NULL, and ``coalesce(..., now())``)
  against the statement text of before, through the same cursor.

    python bench/write_alone.py --dsn postgresql://postgres@127.0.0.1/bench --rounds 3000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import psycopg
from _common import save

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.postgres import Statements
from outboxkit.write.table import _row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rounds", type=int, default=3000)
    args = ap.parse_args()
    migrate(args.dsn)
    sql = Statements("outbox")
    before = sql.insert_one.replace(", available_at)", ")").replace(
        ", coalesce(%s::timestamptz, now()))", ")"
    )
    assert before.count("%s") == 10, "the INSERT changed: update this reference"
    plain, ordered = Outbox(notify=False), Outbox(notify=False, ordered=True)
    rng = random.Random(7)

    def event() -> Event:
        key = f"customer-{rng.randrange(1000)}"
        return Event(topic="orders", event_type="order.placed", key=key, payload={"a": 1})

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        conn.execute("SET synchronous_commit = off")
        cur = conn.cursor()

        def statement(text: str, columns: int) -> Callable[[], None]:
            def run() -> None:
                row = _row(event())[:columns]
                with conn.transaction():
                    cur.execute(text, row)

            return run

        def put(ob: Outbox) -> Callable[[], None]:
            def run() -> None:
                e = event()
                with conn.transaction():
                    ob.put(conn, e)

            return run

        def transaction(ob: Outbox) -> Callable[[], None]:
            def run() -> None:
                e = event()
                with ob.transaction(conn) as tx:
                    tx.put(e)

            return run

        variants = {
            "INSERT before available_at": statement(before, 10),
            "INSERT with available_at": statement(sql.insert_one, 11),
            "put": put(plain),
            "ordered put": put(ordered),
            "transaction()": transaction(plain),
            "ordered transaction()": transaction(ordered),
        }
        items = list(variants.items())
        for _ in range(100):  # warm-up: psycopg prepares after 5 uses, the commit path at once
            for _name, run in items:
                run()
        wall: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, float] = dict.fromkeys(variants, 0.0)
        for i in range(args.rounds):
            rng.shuffle(items)
            for name, run in items:
                c0, t0 = time.process_time(), time.perf_counter()
                run()
                wall[name].append(time.perf_counter() - t0)
                cpu[name] += time.process_time() - c0
            if i % 500 == 499:
                conn.execute("TRUNCATE outbox")
        conn.execute("TRUNCATE outbox")

    pairs = {
        "INSERT with available_at": "INSERT before available_at",
        "ordered put": "put",
        "ordered transaction()": "transaction()",
    }
    results = []
    print(f"{'variant':<28} {'median us':>9} {'client CPU us':>13} {'vs':>28} {'ratio':>7}")
    for name in variants:
        ref = pairs.get(name)
        ratio = (
            statistics.median(a / b for a, b in zip(wall[name], wall[ref], strict=True))
            if ref
            else None
        )
        r = {
            "variant": name,
            "median_us": round(statistics.median(wall[name]) * 1e6, 1),
            "client_cpu_us": round(cpu[name] / args.rounds * 1e6, 1),
            "reference": ref,
            "ratio": None if ratio is None else round(ratio, 4),
        }
        results.append(r)
        print(
            f"{name:<28} {r['median_us']:>9.1f} {r['client_cpu_us']:>13.1f}"
            f" {ref or '':>28} {'' if ratio is None else f'{ratio:7.3f}'}"
        )
    save("write_alone", {"rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
