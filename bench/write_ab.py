"""The write against its floors, and one tree's library against another's, in one run.

Issue 24 item 3's table in one interleaved run: the reference transaction
(``write_overhead.py``) plain (A) and again (A/A control), the floor (a 40-byte row
carried in the COMMIT's message), a naive hand-written INSERT, ``Outbox.put``,
``Outbox.transaction()``, the WAL floor (one prepared ``pg_logical_emit_message`` in the
COMMIT's round trip) and ``Outbox(storage="wal").transaction()``. Each ``--src`` (a
``git worktree`` of another commit) runs the library's variants again in a process of
its own, so two versions of the code are measured transaction by transaction side by
side: every round runs every (process, variant) pair once, in a fresh random order.

The floors are hand-written to the bone (raw libpq, BEGIN as ``conn.transaction()``
sends it, a constant parameter): what the write cannot do without. Per transaction
each process reads its wall time, its own thread's CPU time and its server backend's
CPU time (``/proc/<pid>/schedstat``: a local server). Overheads are against the main
process's plain transaction, with paired bootstrap 95 % intervals over rounds.

    python bench/write_ab.py --embedded --rounds 4000                 # this tree only
    git worktree add /tmp/wab-base <rev>
    python bench/write_ab.py --embedded --src base=/tmp/wab-base/src  # A/B against <rev>
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Generator
from functools import partial
from pathlib import Path
from typing import Any

from psycopg import pq
from psycopg.waiting import Wait

_SYNC = int(pq.ExecStatus.PIPELINE_SYNC)
_OK = (int(pq.ExecStatus.COMMAND_OK), int(pq.ExecStatus.TUPLES_OK))
HERE = Path(__file__).parent
PLAIN = "plain (A)"
FLOOR = "floor: 40-byte row, one index, in the COMMIT's message"
NAIVE = "naive: hand-written INSERT (psycopg)"
TX = "outbox.transaction"
WAL_FLOOR = "WAL floor: prepared pg_logical_emit_message in the COMMIT's round trip"
WAL_TX = "outbox.transaction, storage=wal"
LIBRARY = ("outbox.put", TX, WAL_TX)


# -- the floors' libpq, written out: none of the library's bookkeeping ------------------


def _flush_then_read(pg: Any) -> Generator[Wait, Any, None]:
    """Flush what was sent, then wait for the socket to be readable and read from it."""
    while pg.flush():
        while not (yield Wait.W):
            pass
    yield from _read(pg)


def _read(pg: Any) -> Generator[Wait, Any, None]:
    while not (yield Wait.R):
        pass
    pg.consume_input()


def raw_begin(pg: Any) -> Generator[Wait, Any, None]:
    """BEGIN as ``conn.transaction()`` sends it: one simple query, its result read."""
    pg.send_query(b"BEGIN")
    yield from raw_begin_result(pg)


def raw_begin_result(pg: Any) -> Generator[Wait, Any, None]:
    """Flush a simple query already sent and read its results."""
    yield from _flush_then_read(pg)
    while True:
        if not pg.is_busy():
            while pg.get_result() is not None:
                pass
            return
        yield from _read(pg)


def raw_pipeline(
    pg: Any, sends: list[Callable[[], object]]
) -> Generator[Wait, Any, tuple[list[int], Exception | None]]:
    """The sends and one Sync as a libpq pipeline, every result read up to the Sync:
    each command's status and the first error."""
    pg.enter_pipeline_mode()
    statuses: list[int] = []
    error: Exception | None = None
    try:
        for send in sends:
            send()
        pg.pipeline_sync()
        yield from _flush_then_read(pg)
        while True:
            while not pg.is_busy():
                result = pg.get_result()
                if result is None:
                    continue
                if result.status == _SYNC:
                    return statuses, error
                statuses.append(result.status)
                if result.status not in _OK and error is None:
                    error = RuntimeError(result.error_message.decode())
            yield from _read(pg)
    finally:
        pg.exit_pipeline_mode()


# -- the worker: one connection, the library of its PYTHONPATH -----------------------


def worker(dsn: str, seed: int) -> None:
    import orjson
    import psycopg
    from write_overhead import NEW_ORDER, Order, order_event, psycopg_business

    from outboxkit import Outbox

    conn = psycopg.connect(dsn, autocommit=True)
    pg = conn.pgconn
    rng = random.Random(seed)
    order = [Order(rng)]
    prepared: set[bytes] = set()

    def in_commit(name: bytes, sql: bytes, oid: int, value: Callable[[], bytes]) -> None:
        with conn.lock:
            conn.wait(raw_begin(pg))
        psycopg_business(conn, order[0])
        v = value()
        sends: list[Callable[[], object]] = []
        if name not in prepared:
            sends.append(lambda: pg.send_prepare(name, sql, [oid]))
            prepared.add(name)
        sends.append(lambda: pg.send_query_prepared(name, [v], [1]))
        sends.append(lambda: pg.send_query_params(b"COMMIT", None))
        with conn.lock:
            _statuses, error = conn.wait(raw_pipeline(pg, sends))
        if error is not None:
            raise error

    def wal_value() -> bytes:
        e = order_event(0)  # the event as the library gets it, in a minimal envelope
        return orjson.dumps({"id": str(e.event_id), "topic": e.topic}) + e.payload

    def plain() -> None:
        with conn.transaction():
            psycopg_business(conn, order[0])

    def naive() -> None:
        with conn.transaction():
            e = order_event(psycopg_business(conn, order[0]))
            conn.execute(
                "INSERT INTO outbox (event_id, topic, key, event_type, payload, headers)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (e.event_id, e.topic, e.key, e.event_type, e.payload, "{}"),
            )

    def put(ob: Outbox) -> Callable[[], None]:
        def run() -> None:
            with conn.transaction():
                ob.put(conn, order_event(psycopg_business(conn, order[0])))

        return run

    def transaction(ob: Outbox) -> Callable[[], None]:
        def run() -> None:
            with ob.transaction(conn) as tx:
                tx.put(order_event(psycopg_business(conn, order[0])))

        return run

    variants: dict[str, Callable[[], None]] = {
        PLAIN: plain,
        "plain (A/A control)": plain,
        FLOOR: lambda: in_commit(
            b"ab_floor", b"INSERT INTO bench_small (v) VALUES ($1)", 25, lambda: b"x" * 40
        ),
        NAIVE: naive,
        "outbox.put": put(Outbox(notify=False)),
        TX: transaction(Outbox(notify=False)),
        WAL_FLOOR: lambda: in_commit(
            b"ab_emit",
            b"SELECT pg_logical_emit_message(true, 'outboxkit', $1::bytea)",
            17,
            wal_value,
        ),
        WAL_TX: transaction(Outbox(storage="wal")),
    }
    assert conn.execute(NEW_ORDER, ("warm", 1)).fetchone() is not None
    schedstat = os.open(f"/proc/{pg.backend_pid}/schedstat", os.O_RDONLY)

    def server_ns() -> int:
        return int(os.pread(schedstat, 64, 0).split()[0])

    def lsn() -> int:
        row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
        assert row is not None
        return int(row[0])

    out = sys.stdout
    out.write("\t".join(variants) + "\n")
    out.flush()
    for line in sys.stdin:
        command, _, name = line.rstrip("\n").partition(" ")
        if command == "run":
            order[0] = Order(rng)
            tx = variants[name]
            s0 = server_ns()
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            tx()
            t1 = time.perf_counter_ns()
            c1 = time.thread_time_ns()
            out.write(f"{t1 - t0} {c1 - c0} {server_ns() - s0}\n")
        elif command == "wal":  # WAL bytes per transaction (untimed, one variant at a time)
            start = lsn()
            for _ in range(200):
                order[0] = Order(rng)
                variants[name]()
            out.write(f"{(lsn() - start) / 200}\n")
        else:
            break
        out.flush()
    os.close(schedstat)
    conn.close()


# -- the driver -------------------------------------------------------------------------


class Process:
    """One worker process (one tree's library) and the variants it runs."""

    def __init__(self, label: str, src: Path, dsn: str, seed: int) -> None:
        env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{HERE}"}
        self.label = label
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--dsn", dsn, "--seed", str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdout is not None
        self.variants = self.proc.stdout.readline().rstrip("\n").split("\t")

    def ask(self, line: str) -> str:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None
        assert stdout is not None
        stdin.write(line + "\n")
        reply = stdout.readline()
        if not reply:
            raise RuntimeError(f"worker {self.label} died (see its stderr above)")
        return reply

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(30)


def prepare(dsn: str) -> None:
    import psycopg
    from write_overhead import SCHEMA

    from outboxkit.backends.postgres.migrate import migrate

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("DROP TABLE IF EXISTS bench_small, outbox, outboxkit_schema_versions")
        conn.execute("CREATE TABLE bench_small (id bigserial PRIMARY KEY, v text)")
    migrate(dsn)


Series = dict[tuple[str, str], list[float]]


def run(dsn: str, args: argparse.Namespace) -> None:
    from _common import save
    from write_overhead import BOOTSTRAP_RESAMPLES, machine_facts, server_facts

    prepare(dsn)
    rng = random.Random(args.seed)
    trees = [("this", Path(args.this_src or Path(__file__).resolve().parent.parent / "src"))]
    for spec in args.src:
        label, _, path = spec.partition("=")
        trees.append((label, Path(path).resolve()))
    procs = [Process(label, src, dsn, rng.randrange(1 << 30)) for label, src in trees]
    pairs = [(p, v) for p in procs for v in p.variants]
    wall: Series = {(p.label, v): [] for p, v in pairs}
    cpu: Series = {k: [] for k in wall}
    server: Series = {k: [] for k in wall}
    load_start = machine_facts()["loadavg_start"]
    started = time.time()
    for r in range(args.warmup + args.rounds):
        rng.shuffle(pairs)
        for p, v in pairs:
            t, c, s = (int(x) for x in p.ask(f"run {v}").split())
            if r >= args.warmup:
                k = (p.label, v)
                wall[k].append(t / 1e6)
                cpu[k].append(c / 1e3)
                server[k].append(s / 1e3)
        if (r + 1) % 500 == 0:
            print(f"  {r + 1}/{args.warmup + args.rounds} rounds, {time.time() - started:.0f} s")
    elapsed = time.time() - started
    wal = {(p.label, v): float(p.ask(f"wal {v}")) for p, v in pairs if "A/A" not in v}
    for p in procs:
        p.close()

    results = []
    print(
        f"\n{'tree':<6} {'variant':<72} {'median ms':>9} {'overhead':>9} {'95% CI':>16}"
        f" {'client':>7} {'server':>7} {'WAL B':>6}"
    )
    for label, v in wall:
        base = wall[label, PLAIN]
        xs = wall[label, v]
        lo, hi = (0.0, 0.0) if v == PLAIN else _ci(partial(_overhead, xs, base), args.rounds, rng)
        row = {
            "tree": label,
            "variant": v,
            "median_ms": round(statistics.median(xs), 4),
            "overhead_pct": round(_overhead(xs, base, None), 2),
            "ci95_pct": [round(lo, 2), round(hi, 2)],
            "client_cpu_extra_us": _extra(cpu, label, v),
            "server_cpu_extra_us": _extra(server, label, v),
            "wal_bytes_per_tx": wal.get((label, v)),
        }
        results.append(row)
        w = row["wal_bytes_per_tx"]
        print(
            f"{label:<6} {v:<72} {row['median_ms']:>9.3f} {row['overhead_pct']:>+8.1f}%"
            f" [{lo:>+6.1f}, {hi:>+6.1f}] {row['client_cpu_extra_us']:>+6.0f}u"
            f" {row['server_cpu_extra_us']:>+6.0f}u {'' if w is None else f'{w:6.0f}'}"
        )
    ratios = _ratios(wall, [p.label for p in procs], rng)
    print("\nratios of overheads (each over its own tree's plain transaction):")
    for name, (point, lo, hi) in ratios.items():
        print(f"  {name:<60} {point:6.2f}  95% CI [{lo:.2f}, {hi:.2f}]")
    save(
        args.name,
        {
            "rounds": args.rounds,
            "elapsed_s": round(elapsed, 1),
            "bootstrap_resamples": BOOTSTRAP_RESAMPLES,
            "trees": {label: str(src) for label, src in trees},
            "machine": {**machine_facts(), "loadavg_start": load_start},
            "server": server_facts(dsn),
            "results": results,
            "overhead_ratios": {k: list(v) for k, v in ratios.items()},
        },
    )


def _overhead(xs: list[float], base: list[float], idx: list[int] | None) -> float:
    """Overhead of ``xs`` over ``base`` in % of medians (over the rounds ``idx``)."""
    if idx is not None:
        xs, base = [xs[i] for i in idx], [base[i] for i in idx]
    return (statistics.median(xs) / statistics.median(base) - 1) * 100


def _extra(series: Series, label: str, v: str) -> float:
    return round(statistics.median(series[label, v]) - statistics.median(series[label, PLAIN]), 1)


def _ci(stat: Callable[[list[int]], float], n: int, rng: random.Random) -> tuple[float, float]:
    """Paired bootstrap 95 % interval of ``stat`` over whole rounds (every variant of a
    round ran within milliseconds of the others: resampling rounds keeps that pairing)."""
    from write_overhead import BOOTSTRAP_RESAMPLES

    boots = sorted(stat(rng.choices(range(n), k=n)) for _ in range(BOOTSTRAP_RESAMPLES))
    return boots[int(0.025 * len(boots))], boots[int(0.975 * len(boots)) - 1]


def _ratios(
    wall: Series, labels: list[str], rng: random.Random
) -> dict[str, tuple[float, float, float]]:
    """The targets as ratios of overheads, per tree: transaction() / floor, transaction()
    / naive, WAL transaction() / WAL floor; and each library variant's overhead in a
    --src tree minus this tree's (percentage points), all with 95 % intervals."""

    def over(label: str, v: str, idx: list[int] | None) -> float:
        return _overhead(wall[label, v], wall[label, PLAIN], idx)

    wanted: dict[str, Callable[[list[int] | None], float]] = {}
    for lb in labels:
        for name, a, b in (
            ("transaction() / floor", TX, FLOOR),
            ("transaction() / naive INSERT", TX, NAIVE),
            ("WAL transaction() / WAL floor", WAL_TX, WAL_FLOOR),
        ):
            wanted[f"[{lb}] {name}"] = lambda i, lb=lb, a=a, b=b: over(lb, a, i) / over(lb, b, i)
    for lb in labels[1:]:
        for v in LIBRARY:
            wanted[f"{v}: [{lb}] - [{labels[0]}] (points)"] = lambda i, lb=lb, v=v: (
                over(lb, v, i) - over(labels[0], v, i)
            )
    out = {}
    for name, stat in wanted.items():
        lo, hi = _ci(stat, len(wall[labels[0], PLAIN]), rng)  # type: ignore[arg-type]
        out[name] = (round(stat(None), 3), round(lo, 3), round(hi, 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument(
        "--embedded",
        action="store_true",
        help="a private PostgreSQL 18, fsync on, wal_level=logical (instead of --dsn)",
    )
    ap.add_argument(
        "--src",
        action="append",
        default=[],
        metavar="LABEL=SRC",
        help="also run the library variants from SRC (repeatable)",
    )
    ap.add_argument("--this-src", help="the main process's library (default: this tree's src)")
    ap.add_argument("--rounds", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--name", default="write_ab", help="results file name")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 200 rounds, results to NAME.quick.json"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup = min(args.rounds, 200), 20  # saved to NAME.quick.json
    if args.worker:
        worker(args.dsn, args.seed)
    elif args.embedded:
        from outboxkit.testing.postgres import EmbeddedPostgres

        with EmbeddedPostgres(logical=True) as pg:
            run(pg.dsn, args)
    else:
        run(args.dsn, args)


if __name__ == "__main__":
    main()
