"""Table health of a partitioned outbox (keep + partition drops) next to a plain one (delete).

Both run side by side, on two outbox tables, for the same minutes: per table a writer
process commits events at a steady rate (10 per transaction) and an ``outboxkit relay``
process drains them to Kafka (Tansu). The plain table uses ``retention=delete`` (the
default); the partitioned one ``retention=keep``: the relay marks rows published and
whole partitions are dropped once older than the window. To see drops within minutes the
partitioned table uses 1-minute partitions (``partition_by="minute"``, the test
granularity; production uses day or hour: same code, same statements) with a 2-minute
window (0 s with --quick: a partition goes once its minute is over), and ``outboxkit
partitions maintain``'s function runs every 10 s (5 s with --quick; a cron job; the
relays' own maintenance also runs). Every 5 s the sampler records per table: total size
(heap + indexes + TOAST, summed over partitions), pending backlog, dead tuples and
autovacuum runs (pg_stat_user_tables), and the latency of the relay's claim statement (run
in a transaction that is rolled back). Writes JSON into bench/results/.

    python bench/partitioned_health.py --dsn postgresql://postgres@127.0.0.1/bench \
        [--minutes 10 --rate 5000 | --quick]

``--source cdc`` runs the partitioned table alone, relayed by ``outboxkit relay --source
cdc`` (the table source: rows are never updated nor deleted, partitions are dropped once
the slot confirmed them), on a server with ``wal_level=logical`` (``--embedded`` starts
one); no claim is sampled (that relay does not claim). Results: partitioned_health_cdc.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg
from _common import make_event, save, server_facts
from table_health import Series, claim_latency_ms, median, quarter_and_half, run_load

from outboxkit import Outbox, migrate
from outboxkit.backends.postgres import partitions
from outboxkit.backends.postgres.postgres import Statements

TOPIC = "bench.partitioned"
TABLES = {"delete": "outbox_plain", "partitioned": "outbox_part"}
CDC_TABLES = {"partitioned": "outbox_part_cdc"}
RETENTION = {"delete": "delete", "partitioned": "keep"}
KEEP = dt.timedelta(minutes=2)
QUICK_KEEP = dt.timedelta(0)  # a partition goes as soon as its minute is over and published


def sample_cdc(conn: psycopg.Connection[Any], table: str, stmts: Statements) -> dict[str, Any]:
    """``sample`` without the claim (the CDC relay does not claim; every row stays pending)."""
    return sample(conn, table, stmts, claim=False)


def sample(
    conn: psycopg.Connection[Any], table: str, stmts: Statements, claim: bool = True
) -> dict[str, Any]:
    # The leaves of the table's partition tree (the table itself when plain).
    leaves = (
        "SELECT coalesce(array_agg(relid::oid), ARRAY[%s::regclass::oid])"
        " FROM pg_partition_tree(%s)"
        " WHERE isleaf"
    )
    (rels,) = conn.execute(leaves, (table, table)).fetchone() or ([],)
    size, dead, vacuums, parts = conn.execute(
        "SELECT coalesce(sum(pg_total_relation_size(r)), 0),"
        " (SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables"
        "  WHERE relid = ANY(%s::oid[])),"
        " (SELECT coalesce(sum(autovacuum_count + vacuum_count), 0) FROM pg_stat_user_tables"
        "  WHERE relid = ANY(%s::oid[])),"
        " count(*) FROM unnest(%s::oid[]) AS r",
        (rels, rels, rels),
    ).fetchone() or (0, 0, 0, 0)
    pending, total, written = conn.execute(
        f"SELECT (SELECT count(*) FROM {table} WHERE status = 0),"
        f" (SELECT count(*) FROM {table}),"
        f" coalesce(pg_sequence_last_value(pg_get_serial_sequence('{table}', 'id')), 0)"
    ).fetchone() or (0, 0, 0)
    return {
        "size_mb": float(size) / 1e6,
        "pending": pending,
        "rows": total,
        "written": written,
        "dead_tuples": int(dead),
        "vacuums": int(vacuums),
        "partitions": int(parts),
        "claim_ms": claim_latency_ms(conn, stmts) if claim else 0.0,
    }


def claim_vs_partitions(dsn: str, counts: tuple[int, ...] = (0, 10, 50, 170)) -> dict[str, Any]:
    """The claim's latency (1 000 pending rows, batches of 500, rolled back) against the
    number of partitions: 0 = the plain table, 170 = hourly partitions for a week."""
    out: dict[str, Any] = {}
    for n in counts:
        table = f"claim_probe_{n}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
        if n == 0:
            migrate(dsn, table=table)
        else:
            migrate(dsn, table=table, partition_by="hour")
            partitions.update_settings(dsn, table, ahead=n - 2)  # + this hour + default
            partitions.maintain(dsn, table)
        with psycopg.connect(dsn) as conn:
            Outbox(table).put_many(conn, [make_event(i, topic=TOPIC) for i in range(1000)])
        stmts = Statements(table)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"ANALYZE {table}")
            for _ in range(20):
                claim_latency_ms(conn, stmts)  # warm
            times = sorted(claim_latency_ms(conn, stmts) for _ in range(200))
            conn.execute(f"DROP TABLE {table}")
        out[str(n)] = {"median_ms": median(times), "p90_ms": times[int(len(times) * 0.9)]}
        print(
            f"  claim with {n:3} partitions: median {out[str(n)]['median_ms']:.2f} ms", flush=True
        )
    return out


def _setting(dsn: str, name: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
    return str(row[0]) if row else "?"


def summarize(points: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    first, half = quarter_and_half(points)
    return {
        "samples": points,
        "events_written": points[-1]["written"],
        "events_per_s_written": points[-1]["written"] / seconds,
        "size_mb_first_quarter_max": max(p["size_mb"] for p in first),
        "size_mb_second_half_max": max(p["size_mb"] for p in half),
        "size_mb_second_half_min": min(p["size_mb"] for p in half),
        "claim_ms_first_quarter_median": median([p["claim_ms"] for p in first]),
        "claim_ms_second_half_median": median([p["claim_ms"] for p in half]),
        "claim_ms_p95": sorted(p["claim_ms"] for p in points)[int(len(points) * 0.95)],
        "dead_tuples_second_half_max": max(p["dead_tuples"] for p in half),
        "pending_max": max(p["pending"] for p in points),
        "rows_second_half_max": max(p["rows"] for p in half),
        # rows that left the table (with their partition, or by a DELETE) by the end
        "rows_gone_at_end": points[-1]["written"] - points[-1]["rows"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", help="PostgreSQL database to use (or --embedded)")
    ap.add_argument(
        "--embedded",
        action="store_true",
        help="start an embedded PostgreSQL (outboxkit.testing, autovacuum on) instead",
    )
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=5000.0, help="events/s per table")
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    ap.add_argument(
        "--quick", action="store_true", help="50 s at 1 000 events/s per table, a 0 s window"
    )
    ap.add_argument(
        "--source",
        choices=("poll", "cdc"),
        default="poll",
        help="cdc: the partitioned table alone, relayed from the WAL (needs wal_level=logical)",
    )
    args = ap.parse_args()
    if args.embedded:
        from outboxkit.testing import EmbeddedPostgres

        server = EmbeddedPostgres(fsync=True, logical=args.source == "cdc")
        server.start()
        try:
            args.dsn = server.dsn
            run(args)
        finally:
            server.close()
        return
    if not args.dsn:
        ap.error("give --dsn or --embedded")
    run(args)


def run(args: argparse.Namespace) -> None:
    seconds = 50.0 if args.quick else args.minutes * 60
    rate = 1000.0 if args.quick else args.rate
    per_tx = 10

    cdc = args.source == "cdc"
    tables = CDC_TABLES if cdc else TABLES
    env = {**os.environ, "OUTBOXKIT_DSN": args.dsn}
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        for table in tables.values():
            if cdc:
                subprocess.run(  # a slot left by an earlier run would hold WAL
                    [sys.executable, "-m", "outboxkit", "cdc", "drop", "--table", table],
                    env=env,
                    capture_output=True,
                    check=False,
                )
            conn.execute(f"DROP TABLE IF EXISTS {table}")
    if not cdc:
        migrate(args.dsn, table=TABLES["delete"])
    migrate(args.dsn, table=tables["partitioned"], partition_by="minute")
    keep = QUICK_KEEP if args.quick else KEEP
    maintain_every = 5.0 if args.quick else 10.0
    partitions.update_settings(args.dsn, tables["partitioned"], keep=keep, ahead=3)
    if cdc:
        subprocess.run(
            [sys.executable, "-m", "outboxkit", "cdc", "setup", "--table", tables["partitioned"]],
            env=env,
            check=True,
        )
    results: dict[str, Any] = {
        "machine": server_facts(args.dsn),
        "server": "embedded" if args.embedded else "given --dsn",
        "autovacuum": _setting(args.dsn, "autovacuum"),
        "seconds": seconds,
        "rate_per_table": rate,
        "events_per_tx": per_tx,
        "source": args.source,
        "partitioned": {"partition_by": "minute", "keep_s": keep.total_seconds()},
    }
    dropped: list[str] = []
    logdir = Path(tempfile.mkdtemp(prefix="outboxkit-partitioned-"))

    def maintain() -> None:
        dropped.extend(partitions.maintain(args.dsn, tables["partitioned"]).dropped)

    def show(t: float, series: Series) -> None:
        p = series["partitioned"][-1]
        d = series["delete"][-1] if "delete" in series else None
        print(
            f"  t={t:5.0f}s"
            + (
                f"  delete: {d['size_mb']:6.1f} MB"
                f" claim {d['claim_ms']:5.1f} ms dead {d['dead_tuples']:6}"
                f" pending {d['pending']:6} |"
                if d is not None
                else ""
            )
            + f" partitioned: {p['size_mb']:6.1f} MB claim {p['claim_ms']:5.1f} ms"
            f" dead {p['dead_tuples']:6} pending {p['pending']:6}"
            f" rows {p['rows']:7} parts {p['partitions']:2}"
            f" dropped {len(dropped)}",
            flush=True,
        )

    series = run_load(
        args.dsn,
        args.kafka,
        TOPIC,
        tables,
        RETENTION,
        rate=rate,
        seconds=seconds,
        per_tx=per_tx,
        logdir=logdir,
        sampler=sample_cdc if cdc else sample,
        chore_every=maintain_every,
        chore=maintain,
        show=show,
        relay_args={"partitioned": ["--source", "cdc"]} if cdc else None,
    )

    for mode, points in series.items():
        results[mode] = {**results.get(mode, {}), **summarize(points, seconds)}
    results["partitioned"]["partitions_dropped"] = len(dropped)
    title = f"{rate:.0f} events/s per table for {seconds / 60:.1f} min"
    print(f"\npartitioned table health, {title}")
    for mode in tables:
        r = results[mode]
        print(
            f"  {mode:<11} wrote {r['events_per_s_written']:.0f} ev/s; size max"
            f" {r['size_mb_first_quarter_max']:.1f} MB (1st quarter) ->"
            f" {r['size_mb_second_half_max']:.1f} MB (2nd half); claim median"
            f" {r['claim_ms_first_quarter_median']:.2f} -> {r['claim_ms_second_half_median']:.2f}"
            f" ms; dead tuples max (2nd half) {r['dead_tuples_second_half_max']};"
            f" max pending {r['pending_max']}"
        )
    print(
        f"  partitions dropped by `partitions maintain`: {len(dropped)}"
        + (" (the CDC relay drops its own)" if cdc else "")
    )
    for mode in tables:
        print(f"  {mode}: {results[mode]['rows_gone_at_end']} rows left the table by the end")
    if cdc:
        subprocess.run(
            [sys.executable, "-m", "outboxkit", "cdc", "drop", "--table", tables["partitioned"]],
            env=env,
            check=False,
        )
        save("partitioned_health_cdc", results)
        return
    counts = (0, 10, 50) if args.quick else (0, 10, 50, 170)
    results["claim_vs_partitions"] = claim_vs_partitions(args.dsn, counts)
    # A server without autovacuum (the CI machine's) gets its own file: not comparable.
    save(
        "partitioned_health" + ("" if results["autovacuum"] == "on" else "_autovacuum_off"),
        results,
    )


if __name__ == "__main__":
    main()
