"""Table health under sustained load: size and claim latency over time, delete vs keep+purge.

Both retention modes run side by side, on two outbox tables, for the same
minutes: per table a writer process commits events at a steady rate and an
``outboxkit relay`` process drains them to Kafka (Tansu); the keep table is
purged every 10 s of rows published more than 30 s ago (``outboxkit purge``'s
function). Every 5 s the sampler records each table's total size (heap +
indexes + TOAST), its pending backlog, and the latency of the relay's claim
statement (run in a transaction that is rolled back, so it changes nothing).
Writes JSON and a PNG plot.

    python bench/table_health.py --dsn postgresql://postgres@127.0.0.1/bench [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from _common import ensure_topic, kafka_broker, make_event, save, server_facts

from outboxkit import Outbox, migrate
from outboxkit.backends.postgres.admin import purge
from outboxkit.backends.postgres.postgres import Statements
from outboxkit.testing import spawn_relay

TOPIC = "bench.health"
TABLES = {"delete": "outbox", "keep": "outbox_keep"}
IMG = Path(__file__).parent.parent / "docs" / "img"


def writer(dsn: str, table: str, rate: float, seconds: float, per_tx: int) -> None:
    outbox = Outbox(table)
    tx_rate = rate / per_tx
    with psycopg.connect(dsn) as conn:
        t0 = time.perf_counter()
        i = 0
        while True:
            due = t0 + i / tx_rate
            now = time.perf_counter()
            if now - t0 >= seconds:
                return
            if due > now:
                time.sleep(due - now)
            with conn.transaction():
                outbox.put_many(
                    conn, [make_event(i * per_tx + k, topic=TOPIC) for k in range(per_tx)]
                )
            i += 1


def claim_latency_ms(conn: psycopg.Connection[Any], stmts: Statements) -> float:
    """One claim of up to 1 000 rows (the relay's Kafka batch), rolled back: its cost now."""
    t = time.perf_counter()
    with conn.transaction(force_rollback=True):
        conn.execute(
            stmts.claim_batch,
            {
                "lease": 30.0,
                "token": uuid.uuid4(),
                "relay_id": "probe",
                "limit": 500,
                "max_attempts": 10,
                "commit": "off",
            },
        ).fetchall()
    return (time.perf_counter() - t) * 1000


def sample(conn: psycopg.Connection[Any], table: str, stmts: Statements) -> dict[str, Any]:
    size, pending, total = conn.execute(
        f"SELECT pg_total_relation_size('{table}'),"
        f" (SELECT count(*) FROM {table} WHERE status = 0),"
        f" (SELECT count(*) FROM {table})"
    ).fetchone() or (0, 0, 0)
    return {
        "size_mb": size / 1e6,
        "pending": pending,
        "rows": total,
        "claim_ms": claim_latency_ms(conn, stmts),
    }


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def quarter_and_half(points: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], ...]:
    """The samples of the first quarter of the run (at least one) and of its second half."""
    return points[: max(1, len(points) // 4)], points[len(points) // 2 :]


Sampler = Callable[[psycopg.Connection[Any], str, Statements], dict[str, Any]]
Series = dict[str, list[dict[str, Any]]]


def run_load(
    dsn: str,
    kafka: str | None,
    topic: str,
    tables: dict[str, str],
    retention: dict[str, str],
    *,
    rate: float,
    seconds: float,
    per_tx: int,
    logdir: Path,
    sampler: Sampler,
    chore_every: float,
    chore: Callable[[], None],
    show: Callable[[float, Series], None],
    relay_args: dict[str, list[str]] | None = None,
) -> Series:
    """Per table (``tables``: mode -> table) an ``outboxkit relay`` with its ``retention``
    to ``topic`` on Kafka (``kafka``, or Tansu when None) and a writer process at ``rate``
    events/s for ``seconds``; every 5 s ``chore()`` when ``chore_every`` seconds have passed
    since the last, then one ``sampler`` point per table, then ``show(t, series)``.
    ``relay_args`` (mode -> arguments) replace a mode's ``--retention`` (``--source cdc``).
    Returns the points per mode."""
    with kafka_broker(kafka) as bootstrap:
        ensure_topic(bootstrap, topic)
        relays = [
            spawn_relay(
                dsn,
                f"kafka://{bootstrap}",
                logdir / f"{mode}.log",
                "--table",
                table,
                *(relay_args or {}).get(mode, ["--retention", retention.get(mode, "delete")]),
                log_level="warning",
            )
            for mode, table in tables.items()
        ]
        ctx = multiprocessing.get_context("spawn")
        writers = [
            ctx.Process(target=writer, args=(dsn, t, rate, seconds, per_tx))
            for t in tables.values()
        ]
        series: Series = {mode: [] for mode in tables}
        try:
            for w in writers:
                w.start()
            t0 = time.monotonic()
            last_chore = t0
            stmts = {mode: Statements(t) for mode, t in tables.items()}
            with psycopg.connect(dsn, autocommit=True) as conn:
                while time.monotonic() - t0 < seconds:
                    time.sleep(5.0)
                    now = time.monotonic()
                    if now - last_chore >= chore_every:
                        chore()
                        last_chore = now
                    for mode, table in tables.items():
                        point = {"t": now - t0, **sampler(conn, table, stmts[mode])}
                        series[mode].append(point)
                    show(now - t0, series)
        finally:
            for w in writers:
                w.join(30)
            for r in relays:
                r.terminate()
            for r in relays:
                r.wait(30)
        return series


def plot(series: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for mode, points in series.items():
        t = [p["t"] / 60 for p in points]
        ax1.plot(t, [p["size_mb"] for p in points], label=f"retention={mode}")
        ax2.plot(t, [p["claim_ms"] for p in points], label=f"retention={mode}")
        ax3.plot(t, [p["pending"] for p in points], label=f"retention={mode}")
    ax1.set_ylabel("table size (MB)")
    ax2.set_ylabel("claim latency (ms)")
    ax3.set_ylabel("pending rows")
    ax3.set_xlabel("minutes")
    ax1.set_title(title)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"-> {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=5000.0, help="events/s per table")
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    ap.add_argument("--quick", action="store_true", help="1 minute")
    args = ap.parse_args()
    seconds = 60.0 if args.quick else args.minutes * 60
    per_tx = 10

    for table in TABLES.values():
        migrate(args.dsn, table=table)
    results: dict[str, Any] = {
        "machine": server_facts(args.dsn),
        "seconds": seconds,
        "rate_per_table": args.rate,
        "events_per_tx": per_tx,
    }
    logdir = Path(tempfile.mkdtemp(prefix="outboxkit-health-"))
    purged = 0

    def purge_keep() -> None:
        nonlocal purged
        purged += purge(args.dsn, TABLES["keep"], older_than=dt.timedelta(seconds=30))

    def show(t: float, series: Series) -> None:
        d, k = series["delete"][-1], series["keep"][-1]
        print(
            f"  t={t:5.0f}s  delete: {d['size_mb']:6.1f} MB"
            f" claim {d['claim_ms']:5.1f} ms pending {d['pending']:6}"
            f" | keep: {k['size_mb']:6.1f} MB claim {k['claim_ms']:5.1f} ms"
            f" rows {k['rows']:7}",
            flush=True,
        )

    series = run_load(
        args.dsn,
        args.kafka,
        TOPIC,
        TABLES,
        {mode: mode for mode in TABLES},
        rate=args.rate,
        seconds=seconds,
        per_tx=per_tx,
        logdir=logdir,
        sampler=sample,
        chore_every=10.0,
        chore=purge_keep,
        show=show,
    )

    for mode, points in series.items():
        first, half = quarter_and_half(points)
        results[mode] = {
            "samples": points,
            "size_mb_first_quarter_max": max(p["size_mb"] for p in first),
            "size_mb_second_half_max": max(p["size_mb"] for p in half),
            "claim_ms_first_quarter_median": median([p["claim_ms"] for p in first]),
            "claim_ms_second_half_median": median([p["claim_ms"] for p in half]),
            "claim_ms_max": max(p["claim_ms"] for p in points),
            "pending_max": max(p["pending"] for p in points),
        }
    results["keep"]["purged_rows"] = purged
    title = (
        f"{args.rate:.0f} events/s per table for {seconds / 60:.0f} min"
        f" (keep: purge > 30 s every 10 s)"
    )
    png = "bench_table_health.quick.png" if args.quick else "bench_table_health.png"
    plot(series, IMG / png, title)
    print("\ntable health", title)
    for mode in TABLES:
        r = results[mode]
        print(
            f"  {mode:<7} size max {r['size_mb_first_quarter_max']:.1f} MB (1st quarter) ->"
            f" {r['size_mb_second_half_max']:.1f} MB (2nd half); claim median"
            f" {r['claim_ms_first_quarter_median']:.1f} -> {r['claim_ms_second_half_median']:.1f}"
            f" ms; max pending {r['pending_max']}"
        )
    save("table_health", results)


if __name__ == "__main__":
    main()
