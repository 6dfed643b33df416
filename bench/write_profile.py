"""Where the write overhead goes: the pieces of one outbox write, measured one by one.

Companion of ``write_overhead.py``. Each piece is added to the same reference
transaction, driven through raw libpq calls so the driver's own cost shows
separately, interleaved per round against the plain transaction; then the
cheapest write, ``Outbox.transaction()``, taken apart the same way (its context
alone, the event built beforehand, a table with only a primary key); then the
server's cost per INSERT in bulk, and the plan and WAL of one INSERT. Prints
what docs/benchmarks.md summarises under "Where the microseconds go".

    python bench/write_profile.py --dsn postgresql://postgres@127.0.0.1/bench
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from _common import save
from psycopg import ClientCursor

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.postgres import Statements

SCHEMA = """
DROP TABLE IF EXISTS bench_order_lines, bench_orders, bench_stock, bench_small;
CREATE TABLE bench_orders (id bigserial PRIMARY KEY, customer text NOT NULL,
                           total_cents int NOT NULL, created_at timestamptz DEFAULT now());
CREATE TABLE bench_order_lines (id bigserial PRIMARY KEY, order_id bigint NOT NULL,
                                sku int NOT NULL, qty int NOT NULL);
CREATE TABLE bench_stock (sku int PRIMARY KEY, qty int NOT NULL);
CREATE TABLE bench_small (id bigserial PRIMARY KEY, v text);
INSERT INTO bench_stock SELECT g, 1000000000 FROM generate_series(1, 1000) g;
"""
PAYLOAD = {"order": 1, "customer": "customer-1", "lines": [1, 2, 3], "total_cents": 4200}
COLUMNS = "event_id, topic, key, event_type, aggregate_type, aggregate_id, payload, headers"


def event() -> Event:
    return Event(topic="orders", event_type="order.placed", key="1", payload=PAYLOAD)


def row(e: Event) -> tuple[Any, ...]:
    return (
        e.event_id,
        e.topic,
        e.key,
        e.event_type,
        e.aggregate_type,
        e.aggregate_id,
        e.payload,
        "{}",
        e.occurred_at,
        e.schema_version,
        e.available_at,
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rounds", type=int, default=1500)
    ap.add_argument("--quick", action="store_true", help="300 rounds; results to *.quick.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 300
    results: dict[str, Any] = {"rounds": args.rounds}

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("DROP TABLE IF EXISTS outbox, outboxkit_schema_versions")
    migrate(args.dsn)
    rng = random.Random(11)
    conn = psycopg.connect(args.dsn, autocommit=True)
    pg = conn.pgconn
    literal = ClientCursor(conn)
    insert = Statements("outbox").insert_one
    cursor = conn.cursor()

    def raw(query: bytes) -> Any:
        pg.send_query(query)
        last = None
        while (result := pg.get_result()) is not None:
            if result.error_message:
                raise RuntimeError(result.error_message.decode())
            last = result
        return last

    def business() -> None:
        customer, total = f"c-{rng.randrange(1000)}", rng.randrange(100, 100000)
        result = raw(
            f"INSERT INTO bench_orders (customer, total_cents) VALUES ('{customer}', {total})"
            " RETURNING id".encode()
        )
        order_id = int(result.get_value(0, 0))
        skus = rng.sample(range(1, 1001), 3)
        for sku in skus:
            line = (
                f"INSERT INTO bench_order_lines (order_id, sku, qty) VALUES ({order_id}, {sku}, 1)"
            )
            raw(line.encode())
        for sku in sorted(skus):
            raw(f"UPDATE bench_stock SET qty = qty - 1 WHERE sku = {sku}".encode())

    prebuilt = literal.mogrify(insert, row(event())).encode()
    e0 = event()

    def tx(
        extra: Callable[[], object] | None = None, commit: bytes = b"COMMIT"
    ) -> Callable[[], None]:
        def run() -> None:
            raw(b"BEGIN")
            business()
            if extra is not None:
                extra()
            raw(commit)

        return run

    put_outbox = Outbox(notify=False)

    pieces: dict[str, Callable[[], None]] = {
        "plain (A)": tx(),
        "plain (A/A control)": tx(),
        "+ SELECT 1, raw libpq": tx(lambda: raw(b"SELECT 1")),
        "+ SELECT 1, psycopg cursor": tx(lambda: cursor.execute("SELECT 1")),
        "+ Event(...) only, nothing sent": tx(event),
        "+ 40-byte row in COMMIT's message": tx(
            commit=b"INSERT INTO bench_small (v) VALUES ('" + b"x" * 40 + b"'); COMMIT"
        ),
        "+ outbox INSERT pre-built, in COMMIT's message": tx(commit=prebuilt + b"; COMMIT"),
        "+ outbox INSERT, psycopg cursor (prepared)": tx(lambda: cursor.execute(insert, row(e0))),
        "+ Outbox.put (Event built in the transaction)": tx(lambda: put_outbox.put(conn, event())),
    }

    timings: dict[str, list[float]] = {k: [] for k in pieces}
    items = list(pieces.items())
    for i in range(args.rounds + 200):
        rng.shuffle(items)
        for name, fn in items:
            t0 = time.perf_counter_ns()
            fn()
            if i >= 200:
                timings[name].append((time.perf_counter_ns() - t0) / 1000)
    base = statistics.median(timings["plain (A)"])
    print(f"{'piece added to the reference transaction':<50} {'median us':>10} {'extra':>8}")
    results["pieces"] = {}
    for name, xs in timings.items():
        med = statistics.median(xs)
        results["pieces"][name] = {"median_us": med, "extra_pct": (med / base - 1) * 100}
        print(f"{name:<50} {med:>10.0f} {(med / base - 1) * 100:>+7.1f}%")

    results["commit_path"] = commit_path(args.dsn, args.rounds)

    print("\nserver cost per INSERT, 2000 in one simple-query message (hot):")
    conn.execute(
        "DROP TABLE IF EXISTS outbox_pk_only; CREATE TABLE outbox_pk_only (LIKE outbox"
        " INCLUDING DEFAULTS INCLUDING IDENTITY); ALTER TABLE outbox_pk_only ADD PRIMARY KEY (id)"
    )
    for table in ("outbox", "outbox_pk_only"):
        stmt = Statements(table).insert_one
        batch = b";".join(literal.mogrify(stmt, row(event())).encode() for _ in range(2000))
        best: float = float("inf")
        for _ in range(3):
            raw(b"BEGIN")
            start = time.perf_counter()
            raw(batch)
            best = min(best, time.perf_counter() - start)
            raw(b"ROLLBACK")
        print(f"  {table:<16} {best / 2000 * 1e6:6.1f} us per literal INSERT")
        results.setdefault("bulk_insert_us", {})[table] = best / 2000 * 1e6

    with conn.transaction(force_rollback=True):
        plan = conn.execute(f"EXPLAIN (ANALYZE, WAL, BUFFERS) {insert}", row(event())).fetchall()
    print("\nEXPLAIN (ANALYZE, WAL, BUFFERS) of one INSERT:")
    for (line,) in plan:
        print(f"  {line}")
    results["insert_plan"] = "\n".join(line for (line,) in plan)
    conn.close()
    save("write_profile", results)


def commit_path(dsn: str, rounds: int) -> dict[str, Any]:
    """Outbox.transaction() piece by piece, through psycopg as an application would."""
    import write_overhead as wo

    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("DROP TABLE IF EXISTS outbox_lean")
    migrate(dsn, table="outbox_lean")
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(
            "DROP INDEX outbox_lean_pending_idx, outbox_lean_failed_idx, outbox_lean_published_idx"
        )
    rng = random.Random(5)
    conn = psycopg.connect(dsn, autocommit=True)
    full, lean = Outbox(notify=False), Outbox("outbox_lean", notify=False)
    prebuilt = iter([wo.order_event(i) for i in range(rounds + 300)])

    def plain(o: Any) -> None:
        with conn.transaction():
            wo.psycopg_business(conn, o)

    def context_only(o: Any) -> None:
        with full.transaction(conn):
            wo.psycopg_business(conn, o)

    def with_event(ob: Outbox, built: bool) -> Callable[[Any], None]:
        def run(o: Any) -> None:
            with ob.transaction(conn) as tx:
                order_id = wo.psycopg_business(conn, o)
                tx.put(next(prebuilt) if built else wo.order_event(order_id))

        return run

    pieces: dict[str, Callable[[Any], None]] = {
        "plain (A)": plain,
        "plain (A/A control)": plain,
        "Outbox.transaction(), no event": context_only,
        "Outbox.transaction(), event built beforehand": with_event(full, True),
        "Outbox.transaction(), outbox with a primary key only": with_event(lean, False),
        "Outbox.transaction() + put": with_event(full, False),
    }
    wall: dict[str, list[float]] = {k: [] for k in pieces}
    cpu: dict[str, list[float]] = {k: [] for k in pieces}
    items = list(pieces.items())
    for i in range(rounds + 200):
        rng.shuffle(items)
        for name, fn in items:
            order = wo.Order(rng)
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            fn(order)
            if i >= 200:
                wall[name].append((time.perf_counter_ns() - t0) / 1000)
                cpu[name].append((time.thread_time_ns() - c0) / 1000)
    conn.close()
    base, base_cpu = statistics.median(wall["plain (A)"]), statistics.median(cpu["plain (A)"])
    print(
        f"\n{'Outbox.transaction(), piece by piece':<54} {'median us':>9} {'extra':>7}"
        f" {'client CPU':>10}"
    )
    out = {}
    for name in pieces:
        med = statistics.median(wall[name])
        extra_cpu = statistics.median(cpu[name]) - base_cpu
        out[name] = {
            "median_us": med,
            "extra_pct": (med / base - 1) * 100,
            "client_cpu_extra_us": extra_cpu,
        }
        print(f"{name:<54} {med:>9.0f} {(med / base - 1) * 100:>+6.1f}% {extra_cpu:>+8.0f}us")
    return out


if __name__ == "__main__":
    main()
