"""The write's client cost in instructions: what the library adds to the floor, by part.

CPU time on a shared, loaded machine swings by 2-3x; the number of instructions the
client executes does not. Each case runs under ``valgrind --tool=callgrind`` twice (N
and 0 repetitions after the same warm-up); the difference over N is instructions per
call. Whole transactions (BEGIN, the event, COMMIT; no business statements) against
``--dsn``: psycopg's ``conn.transaction()`` (plain), the two floors written out in libpq
(``write_ab.py``'s), a naive INSERT, ``Outbox.transaction()`` and its WAL storage; then
the parts of ``transaction()`` one by one, with no server round trip.

    python bench/write_instructions.py --dsn postgresql://postgres@127.0.0.1:5432/bench
    PYTHONPATH=/tmp/wab-base/src python bench/write_instructions.py --dsn ...   # another tree
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

PAYLOAD = {"order": 1, "customer": "customer-1", "lines": [1, 2, 3], "total_cents": 4200}
TRANSACTIONS = ("plain", "floor", "wal_floor", "naive", "transaction", "wal_transaction")
PARTS = (
    "Event()",
    "Outbox.transaction(conn)",
    "tx._opening()",
    "tx.put(event), WAL",
    "tx.put(event), table",
    "the WAL floor's content",
    "tx._commands(), WAL",
    "tx._commands(), table",
    "with conn.lock",
    "BEGIN: conn.execute",
    "BEGIN: as conn.transaction() sends it",
)


def cases(dsn: str) -> dict[str, Callable[[], Any]]:
    import orjson
    import psycopg
    from write_ab import raw_begin, raw_begin_result, raw_pipeline

    from outboxkit import Event, Outbox

    conn = psycopg.connect(dsn, autocommit=True)
    pg = conn.pgconn

    def event() -> Event:
        return Event(topic="orders", event_type="order.placed", key="123", payload=PAYLOAD)

    def in_commit(name: bytes, sql: bytes, oid: int, value: Callable[[], bytes]) -> None:
        with conn.lock:
            conn.wait(raw_begin(pg))
        v = value()
        sends = [
            lambda: pg.send_query_prepared(name, [v], [1]),
            lambda: pg.send_query_params(b"COMMIT", None),
        ]
        with conn.lock:
            conn.wait(raw_pipeline(pg, sends))

    pg.prepare(b"wi_floor", b"INSERT INTO bench_small (v) VALUES ($1)", [25])
    pg.prepare(b"wi_emit", b"SELECT pg_logical_emit_message(true, 'outboxkit', $1::bytea)", [17])

    def wal_content() -> bytes:
        e = event()
        return orjson.dumps({"id": str(e.event_id), "topic": e.topic}) + e.payload

    def plain() -> None:
        with conn.transaction():
            pass

    def naive() -> None:
        with conn.transaction():
            e = event()
            conn.execute(
                "INSERT INTO outbox (event_id, topic, key, event_type, payload, headers)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (e.event_id, e.topic, e.key, e.event_type, e.payload, "{}"),
            )

    table, wal = Outbox(notify=False), Outbox(storage="wal")

    def transaction(ob: Outbox) -> Callable[[], None]:
        def run() -> None:
            with ob.transaction(conn) as tx:
                tx.put(event())

        return run

    e = event()
    tx, ttx = wal.transaction(conn), table.transaction(conn)
    with tx, ttx:
        pass  # prepared once; below, the parts run on these two objects, marked open
    tx._active = ttx._active = True

    def put(t: Any) -> Callable[[], None]:
        def run() -> None:
            t._rows = []
            t.put(e)

        return run

    def commands(t: Any, width: int) -> Callable[[], object]:
        def run() -> object:
            t._rows = [[b"x"] * width]
            return t._commands(True)

        return run

    def lock() -> None:
        with conn.lock:
            pass

    def begin(raw: bool) -> Callable[[], None]:
        def run() -> None:  # then the same raw ROLLBACK for both
            if raw:
                with conn.lock:
                    conn.wait(raw_begin(pg))
            else:
                conn.execute("BEGIN")
            with conn.lock:
                pg.send_query(b"ROLLBACK")
                conn.wait(raw_begin_result(pg))

        return run

    return {
        "plain": plain,
        "floor": lambda: in_commit(b"wi_floor", b"", 25, lambda: b"x" * 40),
        "wal_floor": lambda: in_commit(b"wi_emit", b"", 17, wal_content),
        "naive": naive,
        "transaction": transaction(table),
        "wal_transaction": transaction(wal),
        "Event()": event,
        "Outbox.transaction(conn)": lambda: wal.transaction(conn),
        "tx._opening()": tx._opening,
        "tx.put(event), WAL": put(tx),
        "tx.put(event), table": put(ttx),
        "the WAL floor's content": lambda: (
            orjson.dumps({"id": str(e.event_id), "topic": e.topic}) + e.payload
        ),
        "tx._commands(), WAL": commands(tx, 1),
        "tx._commands(), table": commands(ttx, 11),
        "with conn.lock": lock,
        "BEGIN: conn.execute": begin(False),
        "BEGIN: as conn.transaction() sends it": begin(True),
    }


def instructions(dsn: str, case: str, n: int) -> int:
    """Instructions the whole process executed running ``case`` ``n`` times (after 50)."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         __file__, "--dsn", dsn, "--case", case, "--n", str(n)],
        capture_output=True, text=True, check=True, env={**os.environ},
    )  # fmt: skip
    for line in out.stderr.splitlines():
        if "Collected :" in line:
            return int(line.rsplit(":", 1)[1])
    raise RuntimeError(f"no instruction count for {case}: {out.stderr[-500:]}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--n", type=int, default=1000, help="repetitions per case")
    ap.add_argument("--cases", help="comma-separated subset (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="valgrind runs at a time")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="write_instructions", help="results file name")
    args = ap.parse_args()
    if args.case:  # under valgrind: run one case
        run = cases(args.dsn)[args.case]
        for _ in range(50 + args.n):
            run()
        return
    from concurrent.futures import ThreadPoolExecutor

    from _common import save
    from write_ab import prepare

    import outboxkit

    prepare(args.dsn)
    chosen = args.cases.split(",") if args.cases else [*TRANSACTIONS, *PARTS]

    def count(case: str) -> int:
        n = args.n if case in TRANSACTIONS else args.n * 10
        return round((instructions(args.dsn, case, n) - instructions(args.dsn, case, 0)) / n)

    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(zip(chosen, pool.map(count, chosen), strict=True))
    for case, per_call in results.items():
        print(f"  {case:<28} {per_call:>9} instructions")

    save(args.name, {"n": args.n, "library": outboxkit.__file__, "instructions": results})


if __name__ == "__main__":
    main()
