"""What Outbox(ordered=True) costs concurrent writers: the key locks under contention.

The harness of ``bench/concurrent_writers.py`` (N writers in several processes, the
reference transaction, interleaved timed windows, ratios to the no-outbox windows of
the same rounds, pg_stat_activity waits), with the event's key drawn from 1 000 keys
(``Order.customer``) or from 10 hot keys, written by ``put`` or ``transaction()``,
unordered and ordered. The figure of merit is ordered / unordered, paired per round.

    python bench/ordered_writers.py --dsn postgresql://postgres@127.0.0.1/bench
    python bench/ordered_writers.py --dsn ... --writers 16 --rounds 6 --seconds 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import concurrent_writers as cw
import psycopg
from _common import save
from write_overhead import PAYLOAD, Order, psycopg_business

from outboxkit import Event, Outbox

KEY_SPACES = {"1000 keys": None, "10 hot keys": 10}


def _key(o: Order, hot: int | None) -> str:
    return o.customer if hot is None else f"hot-{o.total % hot}"


def _event(o: Order, hot: int | None) -> Event:
    return Event(topic="orders", event_type="order.placed", key=_key(o, hot), payload=PAYLOAD)


def _writes(hot: int | None) -> dict[str, cw.Write]:
    def put(conn: psycopg.Connection[Any], ob: Outbox | None, o: Order) -> None:
        assert ob is not None
        with conn.transaction():
            psycopg_business(conn, o)
            ob.put(conn, _event(o, hot))

    def transaction(conn: psycopg.Connection[Any], ob: Outbox | None, o: Order) -> None:
        assert ob is not None
        with ob.transaction(conn) as tx:
            psycopg_business(conn, o)
            tx.put(_event(o, hot))

    return {"put": put, "transaction": transaction}


def register() -> list[str]:
    """Add this benchmark's modes to the harness (before its processes fork)."""
    modes = ["none"]
    for space, hot in KEY_SPACES.items():
        for kind, write in _writes(hot).items():
            cw.WRITES[f"{kind}, {space}"] = write
            for ordered in (False, True):
                name = f"{kind}{', ordered' if ordered else ''}, {space}"
                cw.MODES[name] = cw.Mode(
                    f"{kind}, {space}", lambda t, o=ordered: Outbox(t, ordered=o)
                )
                modes.append(name)
    return modes


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=2.0, help="length of one window")
    args = ap.parse_args()
    modes = register()
    tables = cw.setup(args.dsn, modes)
    listeners = cw.Listeners(args.dsn, tables)
    started = time.time()
    try:
        results = cw.measure(args.dsn, args.writers, modes, args.rounds, args.seconds, tables)
    finally:
        listeners.close()
    elapsed = time.time() - started
    by_mode = {r["mode"]: r for r in results}
    for r in results:
        if ", ordered" not in r["mode"]:
            continue
        unordered = by_mode[r["mode"].replace(", ordered", "")]
        pairs = zip(r["windows"], unordered["windows"], strict=True)
        ratios = [a["tx_per_s"] / b["tx_per_s"] for a, b in pairs]
        r["ratio_vs_unordered"] = round(statistics.median(ratios), 4)
        r["ratios_vs_unordered"] = [round(x, 4) for x in ratios]

    print(
        f"\n{args.writers} writers in {results[0]['processes']} processes,"
        f" {args.rounds} rounds of {args.seconds:.1f} s windows"
    )
    print(
        f"{'mode':<36} {'tx/s':>7} {'vs none':>8} {'vs unord.':>9} {'p50 ms':>7} {'p99 ms':>7}"
        "  top waits"
    )
    for r in results:
        top = ", ".join(f"{k} {v:.0%}" for k, v in list(r["waits"].items())[:3])
        vs = r.get("ratio_vs_unordered")
        print(
            f"{r['mode']:<36} {r['tx_per_s']:>7.0f} {r['ratio_vs_none']:>8.3f}"
            f" {'' if vs is None else f'{vs:9.3f}':>9} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f}"
            f"  {top}"
        )
    save(
        "ordered_writers",
        {
            "writers": args.writers,
            "rounds": args.rounds,
            "window_s": args.seconds,
            "elapsed_s": round(elapsed, 1),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
