"""MariaDB beside PostgreSQL: the write's overhead, relay throughput, commit → Kafka ack latency.

Uses the private ``mariadbd`` of the tests (``tests/support/mariadb.py``, a free loopback
port, its own data directory), started here with durable commits
(``innodb_flush_log_at_trx_commit=1``, as PostgreSQL's ``synchronous_commit=on``), and the
PostgreSQL at ``--dsn`` for the relay's side-by-side figure. Three parts (``--only``):

* ``write``: the reference transaction of bench/write_overhead.py (an order, 3 lines, 3
  stock updates, COMMIT) through PyMySQL and mysqlclient, plain (twice: the A/A control)
  and with ``outbox.put``, with the event sent with the COMMIT in one round trip by hand
  (``INSERT …; COMMIT`` as one multi-statement query) and through the API that does it,
  ``outbox.transaction()``. Variants interleaved per round in a fresh random order; medians
  and the overhead against the plain transaction.
* ``relay``: N events drained by ``Relay`` with a publisher that confirms at once (the
  database side alone), MariaDB and PostgreSQL taking turns, 3 rounds each.
* ``latency``: one event per transaction at a steady rate (``--writers`` PyMySQL writer
  processes sharing one schedule), the relay polling (MariaDB has no NOTIFY) to Kafka
  (Tansu); from the time COMMIT returned to the broker's ack. PostgreSQL (psycopg writers,
  the same schedule) takes turns with it, with its defaults and polling as MariaDB does.
* ``inprocess``: the same, with the writers as threads of the relay's process (PyMySQL,
  ``put`` + ``commit()`` or ``transaction()``), the relay woken by them
  (backends/mariadb/wakeup.py) or polling (``listen=False``, its 1 s default), at
  ``--rate`` and at ``--low-rate``, the four variants taking turns.

    python bench/mariadb.py --dsn postgresql://postgres@127.0.0.1:5432/bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pymysql
from _common import ensure_topic, kafka_broker, make_event, prepare, reload, save, server_facts
from latency import STAMP, TimingPublisher, measure, pct
from latency import TOPIC as LATENCY_TOPIC
from relay_throughput import ConfirmAtOnce, _relay_run

from outboxkit import Outbox, Relay
from outboxkit import migrate as pg_migrate
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.publishers.kafka import KafkaPublisher

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.mariadb import MariaDB

SCHEMA = [
    "DROP TABLE IF EXISTS bench_order_lines, bench_orders, bench_stock",
    "CREATE TABLE bench_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, customer TEXT NOT NULL,"
    " total_cents INT NOT NULL, created_at DATETIME(6) DEFAULT CURRENT_TIMESTAMP(6))",
    "CREATE TABLE bench_order_lines (id BIGINT AUTO_INCREMENT PRIMARY KEY,"
    " order_id BIGINT NOT NULL, sku INT NOT NULL, qty INT NOT NULL)",
    "CREATE TABLE bench_stock (sku INT PRIMARY KEY, qty INT NOT NULL)",
    "INSERT INTO bench_stock SELECT seq, 1000000000 FROM seq_1_to_1000",
]
NEW_ORDER = "INSERT INTO bench_orders (customer, total_cents) VALUES (%s, %s)"
NEW_LINE = "INSERT INTO bench_order_lines (order_id, sku, qty) VALUES (%s, %s, %s)"
TAKE_STOCK = "UPDATE bench_stock SET qty = qty - 1 WHERE sku = %s"


class DurableMariaDB(MariaDB):
    """The tests' server with ``innodb_flush_log_at_trx_commit`` = ``flush`` (1: durable
    commits, as PostgreSQL's ``synchronous_commit=on``; the tests' server runs with 0)."""

    def __init__(self, flush: int) -> None:
        super().__init__()
        self.flush = flush

    def _command(self) -> list[str]:
        return [
            f"--innodb-flush-log-at-trx-commit={self.flush}"
            if a.startswith("--innodb-flush-log")
            else a
            for a in super()._command()
        ]


# -- the write ----------------------------------------------------------------------------


def business(cur: Any, i: int) -> int:
    cur.execute(NEW_ORDER, (f"customer-{i % 1000}", 4200))
    order_id = int(cur.lastrowid)
    for n in range(3):
        cur.execute(NEW_LINE, (order_id, (i + n) % 1000 + 1, 1 + n))
    for n in range(3):
        cur.execute(TAKE_STOCK, ((i * 7 + n) % 1000 + 1,))
    return order_id


def variants(conn: Any, outbox: Outbox) -> dict[str, Callable[[int], None]]:
    insert = outbox._storage.one  # the statement put() runs, for the with-COMMIT variant

    def plain(i: int) -> None:
        with conn.cursor() as cur:
            business(cur, i)
        conn.commit()

    def put(i: int) -> None:
        with conn.cursor() as cur:
            business(cur, i)
        outbox.put(conn, make_event(i))
        conn.commit()

    def with_commit(i: int) -> None:
        # The event's INSERT and the COMMIT as one multi-statement query: one round trip.
        with conn.cursor() as cur:
            business(cur, i)
            stmt, params = insert(make_event(i))
            sql = cur.mogrify(stmt.text, [str(p) if _is_uuid(p) else p for p in params])
            cur.execute(sql + "; COMMIT")
            while cur.nextset():
                pass

    def transaction(i: int) -> None:
        # The API: the events queued, then their INSERT and the COMMIT in one query.
        with outbox.transaction(conn) as tx, conn.cursor() as cur:
            business(cur, i)
            tx.put(make_event(i))

    return {
        "plain": plain,
        "plain_aa": plain,
        "put": put,
        "put_with_commit": with_commit,
        "transaction": transaction,
    }


def _is_uuid(value: Any) -> bool:
    import uuid

    return isinstance(value, uuid.UUID)


def bench_write(url: str, rounds: int) -> dict[str, Any]:
    import MySQLdb
    from pymysql.constants import CLIENT

    args = connect_args(url)
    admin = pymysql.connect(**args, autocommit=True)
    with admin.cursor() as cur:
        for statement in SCHEMA:
            cur.execute(statement)
        cur.execute("TRUNCATE outbox")
    admin.close()
    outbox = Outbox(storage="mariadb")
    drivers = {
        "pymysql": pymysql.connect(**args, client_flag=CLIENT.MULTI_STATEMENTS),
        "mysqlclient": MySQLdb.connect(**args),  # multi-statements on by default
    }
    results: dict[str, Any] = {}
    for name, conn in drivers.items():
        paths = variants(conn, outbox)
        for i in range(100):  # warm-up
            for run in paths.values():
                run(i)
        times: dict[str, list[float]] = {v: [] for v in paths}
        order = list(paths)
        for i in range(rounds):
            random.shuffle(order)
            for v in order:
                t0 = time.perf_counter()
                paths[v](i)
                times[v].append(time.perf_counter() - t0)
        base = statistics.median(times["plain"])
        results[name] = {
            v: {
                "median_us": statistics.median(t) * 1e6,
                "overhead_pct": (statistics.median(t) / base - 1) * 100,
            }
            for v, t in times.items()
        }
        conn.close()
    return results


# -- relay throughput ---------------------------------------------------------------------


def fill_mariadb(url: str, n: int) -> None:
    conn = pymysql.connect(**connect_args(url))
    outbox = Outbox(storage="mariadb")
    with conn.cursor() as cur:
        cur.execute("DELETE FROM outbox")
    for start in range(0, n, 2000):
        outbox.put_many(conn, [make_event(i) for i in range(start, min(n, start + 2000))])
        conn.commit()
    conn.close()


def bench_relay(url: str, dsn: str, n: int, rounds: int) -> dict[str, Any]:
    prepare(dsn, n)
    runs: dict[str, list[float]] = {"mariadb": [], "postgresql": []}
    for _ in range(rounds):
        for backend in ("mariadb", "postgresql"):
            if backend == "mariadb":
                fill_mariadb(url, n)
                target = url
            else:
                reload(dsn, limit=n)
                target = dsn
            done = asyncio.run(_relay_run(target, ConfirmAtOnce(), n))
            runs[backend].append(done["rate"])
            print(f"  relay {backend:<10} {done['rate']:>9,.0f} events/s", flush=True)
    return {
        "events": n,
        "rates": runs,
        "median": {b: statistics.median(r) for b, r in runs.items()},
        "mariadb_over_postgresql": statistics.median(runs["mariadb"])
        / statistics.median(runs["postgresql"]),
    }


# -- latency ------------------------------------------------------------------------------


def paced_writer(
    kind: str, url: str, plan: tuple[float, float, int, int], start: Any, gate: Any, log: str
) -> None:
    """Writer ``k`` of ``n``: events k, k+n, … each due at start + i/rate, one per
    transaction, on its own connection; logs each event's time taken right after COMMIT
    returned (the relay's latency is measured from there)."""
    rate, seconds, k, n = plan
    if kind == "mariadb":
        outbox, conn = Outbox(storage="mariadb"), pymysql.connect(**connect_args(url))
    else:
        outbox, conn = Outbox(), psycopg.connect(url)
    gate.wait()  # every writer connected
    gate.wait()  # the start time set
    t0 = start.value
    lines = []
    for i in range(k, int(rate * seconds), n):
        delay = t0 + i / rate - time.time()
        if delay > 0:
            time.sleep(delay)
        event = make_event(i, topic=LATENCY_TOPIC, headers={STAMP: repr(time.time())})
        outbox.put(conn, event)
        conn.commit()
        lines.append(f"{event.event_id} {time.time()!r}")
    conn.close()
    Path(log).write_text("\n".join(lines))


def writers(kind: str, url: str, rate: float, seconds: float, n: int, logs: Path) -> None:
    """``n`` paced writer processes sharing one schedule (no catch-up burst at the start:
    the clock starts once all are connected)."""
    ctx = multiprocessing.get_context("spawn")
    start, gate = ctx.Value("d", 0.0), ctx.Barrier(n + 1)
    procs = [
        ctx.Process(
            target=paced_writer,
            args=(kind, url, (rate, seconds, k, n), start, gate, str(logs / f"{k}.log")),
        )
        for k in range(n)
    ]
    for proc in procs:
        proc.start()
    gate.wait()
    start.value = time.time() + 0.05
    gate.wait()
    for proc in procs:
        proc.join()


async def latency_run(
    kind: str, url: str, bootstrap: str, rate: float, seconds: float, n: int, **relay: Any
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as logs:
        args = (kind, url, rate, seconds, n, Path(logs))
        done = await measure(
            url, bootstrap, rate, seconds, writers, args, commit_log=Path(logs), **relay
        )
    return {"writers": n, **relay, **done}


#: The latency variants, MariaDB and PostgreSQL taking turns: the relay's defaults (a 1 s
#: poll on MariaDB, NOTIFY wake-ups on PostgreSQL), then both polling every 10 ms, no linger.
LATENCY = (
    ("mariadb_defaults", "mariadb", {}),
    ("postgresql_defaults", "postgresql", {}),
    ("mariadb_poll_10ms_linger_0", "mariadb", {"poll_interval": 0.01, "linger": 0.0}),
    (
        "postgresql_poll_10ms_linger_0",
        "postgresql",
        {"poll_interval": 0.01, "linger": 0.0, "listen": False},
    ),
)


def latency_part(
    url: str, dsn: str, kafka: str | None, rate: float, seconds: float, n: int
) -> dict[str, Any]:
    """Commit (as COMMIT returned) -> Kafka ack at ``rate``, ``n`` writers, both databases."""
    pg_migrate(dsn)
    found: dict[str, Any] = {}
    with kafka_broker(kafka) as bootstrap:
        ensure_topic(bootstrap, LATENCY_TOPIC)
        for name, kind, relay in LATENCY:
            target = url if kind == "mariadb" else dsn
            if kind == "postgresql":
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("TRUNCATE outbox")
            r = asyncio.run(latency_run(kind, target, bootstrap, rate, seconds, n, **relay))
            found[name] = r
            print(
                f"\ncommit -> Kafka ack at {rate:.0f}/s, {n} writers, {name}:"
                f" {r['events']} events ({r['achieved_rate']:.0f}/s achieved,"
                f" {r['not_acked']} not acked), p50 {r['p50_ms']:.1f} ms,"
                f" p90 {r['p90_ms']:.1f}, p99 {r['p99_ms']:.1f}, max {r['max_ms']:.1f}",
                flush=True,
            )
    return found


# -- latency with the writers in the relay's process (the in-process wake-up) -------------------


def _thread_writer(
    url: str, path: str, plan: tuple[float, float, int, int], t0: float, log: dict[str, float]
) -> None:
    """Writer ``k`` of ``n`` on its own connection: events k, k+n, … due at t0 + i/rate."""
    from pymysql.constants import CLIENT

    rate, seconds, k, n = plan
    outbox = Outbox(storage="mariadb")
    conn = pymysql.connect(**connect_args(url), client_flag=CLIENT.MULTI_STATEMENTS)
    try:
        for i in range(k, int(rate * seconds), n):
            delay = t0 + i / rate - time.time()
            if delay > 0:
                time.sleep(delay)
            event = make_event(i, topic=LATENCY_TOPIC, headers={STAMP: repr(time.time())})
            if path == "transaction":
                with outbox.transaction(conn) as tx:
                    tx.put(event)
            else:
                outbox.put(conn, event)
                conn.commit()
            log[str(event.event_id)] = time.time()
    finally:
        conn.close()


async def in_process_run(
    url: str, bootstrap: str, rate: float, seconds: float, n: int, path: str, **relay: Any
) -> dict[str, Any]:
    """Commit (as COMMIT returned) -> Kafka ack, ``n`` writer threads beside the relay."""
    publisher = TimingPublisher(KafkaPublisher({"bootstrap.servers": bootstrap}))
    await publisher.start()
    task = asyncio.create_task((relay_ := Relay(url, publisher, **relay)).run())
    await asyncio.sleep(1.0)  # connected, idle
    log: dict[str, float] = {}
    t0 = time.time() + 0.05
    await asyncio.gather(
        *(
            asyncio.to_thread(_thread_writer, url, path, (rate, seconds, k, n), t0, log)
            for k in range(n)
        )
    )
    deadline = time.monotonic() + 30
    while len(publisher.acks) < len(log) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    relay_.stop()
    await task
    await publisher.close()
    lat = [(publisher.acks[e] - t) * 1000 for e, t in log.items() if e in publisher.acks]
    times = sorted(log.values())
    return {
        "writers": n,
        "path": path,
        **relay,
        "rate": rate,
        "achieved_rate": len(times) / (times[-1] - times[0]),
        "committed": len(log),
        "not_acked": len(log) - len(lat),
        "p50_ms": statistics.median(lat),
        "p90_ms": pct(lat, 0.90),
        "p99_ms": pct(lat, 0.99),
        "max_ms": max(lat),
        "mean_ms": statistics.fmean(lat),
    }


#: Writers in the relay's process: woken (the default) or polling every second (listen off).
IN_PROCESS = (
    ("put_polling", "put", {"listen": False}),
    ("put_woken", "put", {}),
    ("transaction_polling", "transaction", {"listen": False}),
    ("transaction_woken", "transaction", {}),
)


def in_process_part(
    url: str, kafka: str | None, rates: list[float], seconds: float, n: int, rounds: int
) -> dict[str, Any]:
    """The four in-process variants at each rate, taking turns, ``rounds`` times each."""
    found: dict[str, Any] = {}
    with kafka_broker(kafka) as bootstrap:
        ensure_topic(bootstrap, LATENCY_TOPIC)
        for rate in rates:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in IN_PROCESS}
            for _ in range(rounds):
                for name, path, relay in IN_PROCESS:
                    r = asyncio.run(in_process_run(url, bootstrap, rate, seconds, n, path, **relay))
                    runs[name].append(r)
                    print(
                        f"in-process commit -> Kafka ack at {rate:.0f}/s, {n} writer threads,"
                        f" {name}: {r['committed']} events ({r['achieved_rate']:.0f}/s,"
                        f" {r['not_acked']} not acked), p50 {r['p50_ms']:.1f} ms,"
                        f" p90 {r['p90_ms']:.1f}, p99 {r['p99_ms']:.1f}, max {r['max_ms']:.1f}",
                        flush=True,
                    )
            found[f"{rate:g}_per_s"] = {
                name: {
                    "runs": r,
                    "p50_ms_median": statistics.median(x["p50_ms"] for x in r),
                    "p99_ms_median": statistics.median(x["p99_ms"] for x in r),
                }
                for name, r in runs.items()
            }
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True, help="the PostgreSQL beside it (relay part)")
    ap.add_argument("--only", choices=("write", "relay", "latency", "inprocess"), action="append")
    ap.add_argument("--rounds", type=int, default=3000, help="write rounds per driver")
    ap.add_argument("--events", type=int, default=20000, help="relay events per run")
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--low-rate", type=float, default=20.0, help="inprocess: the idle-ish rate")
    ap.add_argument("--latency-rounds", type=int, default=2, help="inprocess: turns per variant")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument(
        "--writers", type=int, default=8, help="latency: paced writer processes (default 8)"
    )
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    ap.add_argument("--quick", action="store_true", help="few rounds, 5 s of latency")
    ap.add_argument(
        "--flush",
        type=int,
        choices=(0, 1, 2),
        default=1,
        help="innodb_flush_log_at_trx_commit (1: durable commits, the default)",
    )
    args = ap.parse_args()
    parts = args.only or ["write", "relay", "latency", "inprocess"]
    rounds, events = (300, 5000) if args.quick else (args.rounds, args.events)
    seconds = 5.0 if args.quick else args.seconds

    server = DurableMariaDB(args.flush)
    server.start()
    try:
        admin = pymysql.connect(**server.connect_args(), autocommit=True)
        with admin.cursor() as cur:
            cur.execute("CREATE DATABASE bench")
            cur.execute("SELECT VERSION()")
            version = cur.fetchone()[0]
        admin.close()
        url = server.url_for("bench")
        migrate(url)
        results: dict[str, Any] = {
            "machine": server_facts(args.dsn),
            "mariadb": {"version": version, "innodb_flush_log_at_trx_commit": args.flush},
        }
        if "write" in parts:
            results["write"] = bench_write(url, rounds)
            print(f"\nreference transaction on MariaDB {version}, {rounds} rounds per driver")
            for driver, row in results["write"].items():
                for v, r in row.items():
                    print(
                        f"  {driver:<12} {v:<16} {r['median_us']:>9.0f} us"
                        f" {r['overhead_pct']:>+7.1f} %"
                    )
        if "relay" in parts:
            results["relay"] = bench_relay(url, args.dsn, events, 3)
            m = results["relay"]["median"]
            print(
                f"\nrelay, {events} events, confirm-at-once publisher: MariaDB"
                f" {m['mariadb']:,.0f}/s, PostgreSQL {m['postgresql']:,.0f}/s,"
                f" ratio {results['relay']['mariadb_over_postgresql']:.2f}"
            )
        if "latency" in parts:
            results["latency"] = latency_part(
                url, args.dsn, args.kafka, args.rate, seconds, args.writers
            )
        if "inprocess" in parts:
            results["inprocess"] = in_process_part(
                url, args.kafka, [args.rate, args.low_rate], seconds, 4, args.latency_rounds
            )
        name = "mariadb" if args.flush == 1 else f"mariadb_flush{args.flush}"
        save(name if args.only is None else "_".join([name, *parts]), results)
    finally:
        server.close()


if __name__ == "__main__":
    main()
