"""Many concurrent writers on MariaDB: the outbox's throughput beside none, deadlocks, lock waits.

bench/concurrent_writers.py's question on MariaDB. N writers (16 by default: processes x
threads, one PyMySQL or mysqlclient connection each) run the reference transaction of
bench/mariadb.py (an order, 3 lines, 3 stock updates, COMMIT) as fast as they can, in timed
windows, one mode a window, the modes in a fresh random order each round:

* ``none``: the business rows alone;
* ``put``: the same and ``outbox.put`` before ``conn.commit()``;
* ``transaction``: ``with outbox.transaction(conn) as tx`` (the event's INSERT sent with
  the COMMIT, one round trip).

Each writer retries a transaction MariaDB gave up (deadlock 1213, lock wait timeout 1205)
the way docs/mariadb.md says to: run it again from its start, up to 5 times. It counts the
conflicts outboxkit raised (``TransactionConflictError``: at the outbox's INSERT or its
COMMIT) apart from those of the business statements (the driver's error). Per window the
server's ``Innodb_deadlocks``, ``Innodb_row_lock_waits`` and ``Innodb_row_lock_time``
deltas. A relay with the library's defaults (a publisher that confirms at once) drains the
outbox during the run, its claims and deletes beside the writers' INSERTs (``--no-relay``).

The server is the tests' private ``mariadbd`` (its own data directory, a free port) with
durable commits (``innodb_flush_log_at_trx_commit=1``), or ``--url`` (the machine's shared
server on 3306 may be used; nothing is reconfigured, a database of its own is created).

    python bench/mariadb_writers.py                       # 16 writers, 5 rounds of 5 s
    python bench/mariadb_writers.py --quick
    python bench/mariadb_writers.py --url mysql://root@127.0.0.1:3306/bench_writers
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections import Counter
from multiprocessing.connection import Connection as Pipe
from typing import Any

import psutil
import pymysql
from _common import make_event, save
from concurrent_writers import RelayProcess
from mariadb import SCHEMA, DurableMariaDB, business
from pymysql.constants import CLIENT

from outboxkit import Outbox, TransactionConflictError
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args

MODES = ("none", "put", "transaction")
ATTEMPTS = 5
COUNTERS = ("Innodb_deadlocks", "Innodb_row_lock_waits", "Innodb_row_lock_time")


def _connect(driver: str, url: str) -> Any:
    args = connect_args(url)
    if driver == "mysqlclient":
        import MySQLdb

        return MySQLdb.connect(**{k: v for k, v in args.items()})
    return pymysql.connect(**args, client_flag=CLIENT.MULTI_STATEMENTS)


def _once(mode: str, conn: Any, outbox: Outbox, i: int) -> None:
    if mode == "none":
        with conn.cursor() as cur:
            business(cur, i)
        conn.commit()
    elif mode == "put":
        with conn.cursor() as cur:
            business(cur, i)
        outbox.put(conn, make_event(i))
        conn.commit()
    else:
        with outbox.transaction(conn) as tx, conn.cursor() as cur:
            business(cur, i)
            tx.put(make_event(i))


def _errno(exc: BaseException) -> int | None:
    code = exc.args[0] if exc.args else None
    return code if isinstance(code, int) else None


def _write(mode: str, conn: Any, outbox: Outbox, i: int, counts: Counter[str]) -> None:
    """One business transaction, run again from its start after a conflict (the pattern)."""
    for _ in range(ATTEMPTS):
        try:
            _once(mode, conn, outbox, i)
        except TransactionConflictError as conflict:
            counts[f"outbox_{conflict.errno}"] += 1
        except Exception as exc:
            if _errno(exc) not in (1213, 1205):
                raise
            counts[f"business_{_errno(exc)}"] += 1
        else:
            counts["committed"] += 1
            return
        conn.rollback()
    counts["gave_up"] += 1


def _writer_thread(
    mode: str, conn: Any, outbox: Outbox, plan: tuple[int, int, float], totals: Counter[str]
) -> None:
    """Transactions ``first``, ``first + step``, … until ``deadline``; counts into ``totals``."""
    i, step, deadline = plan
    counts: Counter[str] = Counter()
    while time.monotonic() < deadline:
        _write(mode, conn, outbox, i, counts)
        i += step
    with _TOTALS_LOCK:
        totals.update(counts)


_TOTALS_LOCK = threading.Lock()


def _writer_process(url: str, driver: str, threads: int, first: int, step: int, pipe: Pipe) -> None:
    outbox = Outbox()
    conns = [_connect(driver, url) for _ in range(threads)]
    pipe.send("ready")
    window = 0
    while (order := pipe.recv()) is not None:
        mode, seconds = order
        totals: Counter[str] = Counter()
        deadline = time.monotonic() + seconds
        start = first + window * 1_000_000  # a window's order numbers are its own
        workers = [
            threading.Thread(
                target=_writer_thread,
                args=(mode, conns[k], outbox, (start + k, step, deadline), totals),
            )
            for k in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        window += 1
        pipe.send(dict(totals))
    for conn in conns:
        conn.close()


class Writers:
    def __init__(self, url: str, driver: str, processes: int, threads: int) -> None:
        ctx = mp.get_context("fork")
        step = processes * threads
        self.pipes: list[Pipe] = []
        self.procs = []
        for p in range(processes):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_writer_process,
                args=(url, driver, threads, p * threads, step, theirs),
                daemon=True,
            )
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"

    def window(self, mode: str, seconds: float) -> Counter[str]:
        for pipe in self.pipes:
            pipe.send((mode, seconds))
        totals: Counter[str] = Counter()
        for pipe in self.pipes:
            totals.update(pipe.recv())
        return totals

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(10)


def _busy() -> float:
    """The whole machine's busy CPU seconds so far (every core, every process)."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def _status(url: str) -> dict[str, int]:
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SHOW GLOBAL STATUS WHERE Variable_name IN ("
                + ", ".join(["%s"] * len(COUNTERS))
                + ")",
                COUNTERS,
            )
            return {name: int(value) for name, value in cur.fetchall()}
    finally:
        conn.close()


def _facts(url: str) -> dict[str, Any]:
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    with conn.cursor() as cur:
        cur.execute(
            "SELECT VERSION(), @@innodb_flush_log_at_trx_commit, @@innodb_lock_wait_timeout,"
            " @@innodb_autoinc_lock_mode, @@tx_isolation"
        )
        version, flush, wait, autoinc, isolation = cur.fetchone()
    conn.close()
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "mariadb": version,
        "innodb_flush_log_at_trx_commit": flush,
        "innodb_lock_wait_timeout": wait,
        "innodb_autoinc_lock_mode": autoinc,
        "writers_isolation": isolation,
    }


def setup(url: str) -> None:
    migrate(url)
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    with conn.cursor() as cur:
        for statement in SCHEMA:
            cur.execute(statement)
        cur.execute("DELETE FROM outbox")
    conn.close()


def _create_database(url: str) -> None:
    args = connect_args(url)
    name = args.pop("database")
    conn = pymysql.connect(**args, autocommit=True)
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `{name}`")
    conn.close()


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    setup(url)
    relay = None if args.no_relay else RelayProcess(url, "outbox")
    writers = Writers(url, args.driver, args.processes, args.threads)
    windows: list[dict[str, Any]] = []
    try:
        writers.window("none", 1.0)  # warm-up
        for r in range(args.rounds):
            order = list(MODES)
            random.shuffle(order)
            for mode in order:
                before, busy = _status(url), _busy()
                counts = writers.window(mode, args.seconds)
                busy, after = _busy() - busy, _status(url)
                delta = {k: after[k] - before[k] for k in COUNTERS}
                rate = counts["committed"] / args.seconds
                cpu = busy / max(counts["committed"], 1) * 1e6
                windows.append(
                    {
                        "round": r,
                        "mode": mode,
                        "tps": rate,
                        "machine_cpu_us_per_tx": cpu,
                        "load1": os.getloadavg()[0],
                        **counts,
                        **delta,
                    }
                )
                print(
                    f"  round {r} {mode:<12} {rate:>8,.0f} tx/s  {cpu:>6,.0f} CPU µs/tx"
                    f"  deadlocks {delta['Innodb_deadlocks']:>3}"
                    f"  lock waits {delta['Innodb_row_lock_waits']:>5}  {dict(counts)}",
                    flush=True,
                )
    finally:
        writers.close()
        if relay is not None:
            relay.close()
    return summarise(windows, args.rounds)


def summarise(windows: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    by = {m: [w for w in windows if w["mode"] == m] for m in MODES}
    per_round = {
        m: [
            next(w["tps"] for w in by[m] if w["round"] == r)
            / next(w["tps"] for w in by["none"] if w["round"] == r)
            for r in range(rounds)
        ]
        for m in MODES
    }
    ratios = {m: statistics.median(per_round[m]) for m in MODES}

    def total(m: str, key: str) -> int:
        return sum(int(w.get(key, 0)) for w in by[m])

    return {
        "windows": windows,
        "summary": {
            m: {
                "median_tps": statistics.median(w["tps"] for w in by[m]),
                "machine_cpu_us_per_tx": statistics.median(
                    w["machine_cpu_us_per_tx"] for w in by[m]
                ),
                "ratio_to_none": ratios[m],
                "ratios_per_round": per_round[m],
                "committed": total(m, "committed"),
                "innodb_deadlocks": total(m, "Innodb_deadlocks"),
                "innodb_row_lock_waits": total(m, "Innodb_row_lock_waits"),
                "innodb_row_lock_time_ms": total(m, "Innodb_row_lock_time"),
                "outbox_conflicts": total(m, "outbox_1213") + total(m, "outbox_1205"),
                "business_conflicts": total(m, "business_1213") + total(m, "business_1205"),
                "gave_up": total(m, "gave_up"),
            }
            for m in MODES
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", help="a MariaDB to use (default: a private mariadbd, durable)")
    ap.add_argument("--driver", choices=("pymysql", "mysqlclient"), default="pymysql")
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="writer threads per process")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of one window")
    ap.add_argument("--no-relay", action="store_true", help="no relay draining the outbox")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 s")
    ap.add_argument("--name", default="mariadb_writers", help="results file name")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.seconds = 2, 2.0
    server = None
    url = args.url
    if url is None:
        server = DurableMariaDB(flush=1)
        server.start()
        url = server.url_for("bench_writers")
    try:
        _create_database(url)
        print(
            f"{args.processes * args.threads} writers ({args.processes} processes x"
            f" {args.threads} threads, {args.driver}), relay: {not args.no_relay}",
            flush=True,
        )
        facts = _facts(url)
        result = measure(url, args)
    finally:
        if server is not None:
            server.close()
    for mode, s in result["summary"].items():
        print(
            f"{mode:<12} {s['median_tps']:>8,.0f} tx/s  x{s['ratio_to_none']:.3f} of none"
            f"  {s['machine_cpu_us_per_tx']:,.0f} CPU µs/tx"
            f"  deadlocks {s['innodb_deadlocks']} (outbox {s['outbox_conflicts']},"
            f" business {s['business_conflicts']})  lock waits {s['innodb_row_lock_waits']}"
        )
    save(
        args.name,
        {
            "writers": args.processes * args.threads,
            "processes": args.processes,
            "threads": args.threads,
            "driver": args.driver,
            "relay": not args.no_relay,
            "rounds": args.rounds,
            "seconds": args.seconds,
            "server": "private mariadbd, innodb_flush_log_at_trx_commit=1"
            if args.url is None
            else args.url,
            "command": " ".join(["python", "bench/mariadb_writers.py", *sys.argv[1:]]),
            "machine": facts,
            **result,
        },
    )


if __name__ == "__main__":
    main()
