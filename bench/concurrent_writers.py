"""Many concurrent writers: the throughput a service keeps with the outbox, and their waits.

N writers (1..64 threads, spread over several processes so the GIL is not the
limit, one connection each) run the reference transaction of
``bench/write_overhead.py`` (an order, 3 lines, 3 stock updates, commit;
``synchronous_commit=on``) as fast as they can, in timed windows. Every mode
(no outbox, ``put``, ``Outbox.transaction()``, ``execute_with``; NOTIFY on and
off; diagnostic variants) gets one window per round, the modes of a writer
count in a fresh random order each round, so each mode's throughput is compared
with the no-outbox windows of the same moments (ratio of medians over rounds).

During every window a sampler reads ``pg_stat_activity`` every 10 ms and counts
what the writers' backends are doing: ``CPU`` (active, no wait event),
``Client:ClientRead`` (waiting for the client: the writer's own CPU, the
network), ``Lock:object`` (NOTIFY's commit-time lock), ``LWLock:WALWrite``,
``IO:WALSync``, ``LWLock:BufferContent`` (the right edge of an index), ...
The whole machine's CPU per transaction is measured per window too.

A relay with the library's defaults drains ``outbox`` during the run (its publisher
confirms at once; ``--no-relay`` to leave it out), a LISTEN session stays open on each
outbox's channel, and every window starts from empty tables. The writers' NOTIFY is
gated (backends/postgres/postgres.py ``WAKE_GATE``): they notify only while a relay waits for work.
The ``notify always`` modes hold the gate for the whole window, so every commit
notifies, as before the gate.

    python bench/concurrent_writers.py --dsn postgresql://postgres@127.0.0.1/bench
    python bench/concurrent_writers.py --dsn ... --quick
    python bench/concurrent_writers.py --dsn ... --writers 16 --modes none,transaction

Adding a mode is one entry in ``MODES``: a name, the write (``WRITES``), how to
build the ``Outbox``, and optionally the table and its one-time preparation.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from typing import Any

import psutil
import psycopg
from _common import save
from write_overhead import (
    SCHEMA,
    Order,
    order_event,
    psycopg_business,
    psycopg_business_attached,
)

from outboxkit import Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.postgres import Statements

APP = "outboxkit-bench:writer"

# -- what a writer does in one transaction -------------------------------------------

Write = Callable[[psycopg.Connection[Any], Outbox | None, Order], None]


def write_none(conn: psycopg.Connection[Any], _ob: Outbox | None, o: Order) -> None:
    with conn.transaction():
        psycopg_business(conn, o)


def write_put(conn: psycopg.Connection[Any], ob: Outbox | None, o: Order) -> None:
    assert ob is not None
    with conn.transaction():
        ob.put(conn, order_event(psycopg_business(conn, o)))


def write_transaction(conn: psycopg.Connection[Any], ob: Outbox | None, o: Order) -> None:
    assert ob is not None
    with ob.transaction(conn) as tx:
        tx.put(order_event(psycopg_business(conn, o)))


def write_execute_with(conn: psycopg.Connection[Any], ob: Outbox | None, o: Order) -> None:
    assert ob is not None
    with conn.transaction():
        psycopg_business_attached(conn, o, ob)


WRITES: dict[str, Write] = {
    "none": write_none,
    "put": write_put,
    "transaction": write_transaction,
    "execute_with": write_execute_with,
}


@dataclass(frozen=True)
class Mode:
    """One contender: the write it runs, the Outbox it writes through, the table it needs.

    ``prepare(dsn, table)`` runs once before the measurement (after the table is
    migrated with ``migrate_options``): e.g. drop an index to attribute its cost.
    """

    write: str
    outbox: Callable[[str], Outbox] | None = None  # table name -> Outbox
    table: str = "outbox"
    migrate_options: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[psycopg.Connection[Any], str], None] | None = None
    diagnostic: bool = False  # not a library default: shown apart, left out of --quick
    # Hold the outbox's wake-up gate (as a waiting relay does) for the whole window:
    # every transaction notifies, as every one did before the gate (issue 14).
    notify_always: bool = False


def _drop_pending_index(conn: psycopg.Connection[Any], table: str) -> None:
    conn.execute(f"DROP INDEX IF EXISTS {table}_pending_idx")


def _random_ids(conn: psycopg.Connection[Any], table: str) -> None:
    # Attribution only: ids spread over the key space instead of the right edge
    # (the relay needs the identity order; this table is never relayed).
    conn.execute(f"ALTER TABLE {table} ALTER COLUMN id DROP IDENTITY IF EXISTS")
    conn.execute(f"ALTER TABLE {table} ALTER COLUMN id SET DEFAULT (random() * 9.2e18)::bigint")
    _drop_pending_index(conn, table)


MODES: dict[str, Mode] = {
    "none": Mode("none"),
    "put": Mode("put", lambda t: Outbox(t)),
    "put, notify always": Mode("put", lambda t: Outbox(t), notify_always=True),
    "put, notify off": Mode("put", lambda t: Outbox(t, notify=False)),
    "transaction": Mode("transaction", lambda t: Outbox(t)),
    "transaction, notify always": Mode("transaction", lambda t: Outbox(t), notify_always=True),
    "transaction, notify off": Mode("transaction", lambda t: Outbox(t, notify=False)),
    "execute_with": Mode("execute_with", lambda t: Outbox(t)),
    "execute_with, notify always": Mode("execute_with", lambda t: Outbox(t), notify_always=True),
    "execute_with, notify off": Mode("execute_with", lambda t: Outbox(t, notify=False)),
    # Outbox(storage="wal"): a transactional logical message per event, no row (issue 15)
    "wal, put": Mode("put", lambda t: Outbox(t, storage="wal")),
    "wal, transaction": Mode("transaction", lambda t: Outbox(t, storage="wal")),
    "wal, execute_with": Mode("execute_with", lambda t: Outbox(t, storage="wal")),
    # Attribution of the right-edge suspects (not library configurations):
    "transaction, notify off, no pending index": Mode(
        "transaction",
        lambda t: Outbox(t, notify=False),
        table="outbox_nopending",
        prepare=_drop_pending_index,
        diagnostic=True,
    ),
    "transaction, notify off, random ids, no pending index": Mode(
        "transaction",
        lambda t: Outbox(t, notify=False),
        table="outbox_randomid",
        prepare=_random_ids,
        diagnostic=True,
    ),
}

# --quick: the library's write paths with their defaults, and NOTIFY's share.
QUICK_MODES = ["none", "put", "transaction", "transaction, notify always", "execute_with"]


# -- the writer processes -------------------------------------------------------------


def _writer_process(dsn: str, threads: int, modes: list[str], seed: int, pipe: Pipe) -> None:
    """One process of ``threads`` writers; runs windows on command, reports counts."""
    conns = [psycopg.connect(dsn, autocommit=True, application_name=APP) for _ in range(threads)]
    # One Outbox per (thread, mode): as an application holds one per table.
    outboxes = [
        {
            name: (m.outbox(m.table) if m.outbox else None)
            for name, m in MODES.items()
            if name in modes
        }
        for _ in range(threads)
    ]
    rngs = [random.Random(seed * 1000 + i) for i in range(threads)]
    pipe.send("ready")
    while True:
        cmd = pipe.recv()
        if cmd is None:
            break
        name, start_at, stop_at = cmd
        write = WRITES[MODES[name].write]
        counts = [0] * threads
        lat: list[list[float]] = [[] for _ in range(threads)]
        errors: list[str] = []

        def run(i: int) -> None:
            conn, ob, rng = conns[i], outboxes[i][name], rngs[i]  # noqa: B023
            while time.time() < start_at:  # noqa: B023
                time.sleep(0.001)
            n = 0
            samples = lat[i]  # noqa: B023
            try:
                while True:
                    o = Order(rng)
                    t0 = time.perf_counter()
                    if time.time() >= stop_at:  # noqa: B023
                        break
                    write(conn, ob, o)  # noqa: B023
                    samples.append(time.perf_counter() - t0)
                    n += 1
            except Exception as exc:  # reported, not fatal to the others
                errors.append(f"{type(exc).__name__}: {exc}")  # noqa: B023
            counts[i] = n  # noqa: B023

        ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        flat = [x for xs in lat for x in xs]
        pipe.send({"count": sum(counts), "latencies": flat, "errors": errors[:3]})
    for c in conns:
        c.close()


class Writers:
    """``n`` writers in ``procs`` processes, kept across windows (connections stay open)."""

    def __init__(self, dsn: str, n: int, modes: list[str]) -> None:
        self.procs_n = min(n, max(2, min(8, n // 4 or 1)))
        per = [n // self.procs_n + (1 if i < n % self.procs_n else 0) for i in range(self.procs_n)]
        ctx = mp.get_context("fork")
        self.pipes: list[Pipe] = []
        self.procs: list[Any] = []
        for i, threads in enumerate(per):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_writer_process, args=(dsn, threads, modes, i, child), daemon=True
            )
            p.start()
            self.pipes.append(parent)
            self.procs.append(p)
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("a writer process did not start")

    def window(self, mode: str, seconds: float) -> dict[str, Any]:
        start = time.time() + 0.2
        for pipe in self.pipes:
            pipe.send((mode, start, start + seconds))
        out = [pipe.recv() for pipe in self.pipes]
        lat = sorted(x for r in out for x in r["latencies"])
        errors = [e for r in out for e in r["errors"]]
        if errors:
            raise RuntimeError(f"{mode}: writer failed: {errors[0]}")
        return {"count": sum(r["count"] for r in out), "latencies": lat}

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# -- sampling ----------------------------------------------------------------------


class WaitSampler:
    """Samples the writers' backends in pg_stat_activity every ``interval`` seconds."""

    SQL = (
        "SELECT CASE WHEN wait_event IS NOT NULL THEN wait_event_type || ':' || wait_event"
        " WHEN state = 'active' THEN 'CPU' ELSE coalesce(state, '?') END, count(*)"
        " FROM pg_stat_activity WHERE application_name = %s GROUP BY 1"
    )

    def __init__(self, dsn: str, interval: float = 0.01) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.interval = interval
        self.counts: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.counts = Counter()
        self.samples = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for what, n in self.conn.execute(self.SQL, (APP,)).fetchall():
                self.counts[what] += n
            self.samples += 1
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        total = sum(self.counts.values()) or 1
        return {k: round(v / total, 4) for k, v in self.counts.most_common()}

    def close(self) -> None:
        self.conn.close()


class GateHolder:
    """Holds an outbox's wake-up gate in a session of its own, as a waiting relay does."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)

    def hold(self, table: str) -> None:
        self.conn.execute(Statements(table).try_wake_lock)

    def release(self, table: str) -> None:
        self.conn.execute("SELECT pg_advisory_unlock_all()")

    def close(self) -> None:
        self.conn.close()


class ConfirmAtOnce:
    name = "confirm-at-once"

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def publish_batch(self, messages: Any) -> list[Any]:
        from outboxkit import PublishResult

        return [PublishResult.success()] * len(messages)


def _relay_process(dsn: str, table: str, stop: Any) -> None:
    """A relay with the library's defaults and a publisher that confirms at once."""
    import asyncio

    from outboxkit import Relay

    async def run() -> None:
        relay = Relay(dsn, ConfirmAtOnce(), table=table)
        task = asyncio.create_task(relay.run())
        while not stop.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        relay.stop()
        await task

    asyncio.run(run())


class RelayProcess:
    def __init__(self, dsn: str, table: str) -> None:
        ctx = mp.get_context("fork")
        self.stop = ctx.Event()
        self.proc = ctx.Process(target=_relay_process, args=(dsn, table, self.stop), daemon=True)
        self.proc.start()

    def close(self) -> None:
        self.stop.set()
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()


class Listeners:
    """One LISTEN session per outbox channel, draining notifications as an idle relay's would."""

    def __init__(self, dsn: str, tables: list[str]) -> None:
        self._stop = threading.Event()
        self.received = 0
        self._threads = [
            threading.Thread(target=self._run, args=(dsn, t), daemon=True) for t in tables
        ]
        for t in self._threads:
            t.start()

    def _run(self, dsn: str, table: str) -> None:
        with psycopg.connect(dsn, autocommit=True, application_name="outboxkit-bench:listen") as c:
            c.execute(f'LISTEN "{Statements(table).channel}"')
            while not self._stop.is_set():
                for _ in c.notifies(timeout=0.2):
                    self.received += 1

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return float(t.user + t.system + t.nice + t.irq + t.softirq)


# -- the run -----------------------------------------------------------------------


def setup(dsn: str, modes: list[str]) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    tables = sorted({MODES[m].table for m in modes if MODES[m].outbox is not None})
    for table in tables:
        options = next(MODES[m].migrate_options for m in modes if MODES[m].table == table)
        migrate(dsn, table=table, **options)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for m in modes:
                if MODES[m].table == table and MODES[m].prepare is not None:
                    MODES[m].prepare(conn, table)  # type: ignore[misc]
    return tables


def reset(dsn: str, tables: list[str]) -> None:
    """Every window starts from empty tables (the outbox as a keeping-up relay leaves it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE bench_orders, bench_order_lines" + "".join(f", {t}" for t in tables))
        conn.execute("CHECKPOINT")


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


def measure(
    dsn: str, writers: int, modes: list[str], rounds: int, seconds: float, tables: list[str]
) -> list[dict[str, Any]]:
    pool = Writers(dsn, writers, modes)
    sampler = WaitSampler(dsn)
    gate = GateHolder(dsn)
    windows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        pool.window("none", min(1.0, seconds))  # warm-up: connections, caches
        for r in range(rounds):
            order = modes[:]
            random.Random(writers * 100 + r).shuffle(order)
            for mode in order:
                reset(dsn, tables)
                spec = MODES[mode]
                if spec.notify_always:
                    gate.hold(spec.table)
                sampler.start()
                c0, t0 = _machine_busy(), time.perf_counter()
                res = pool.window(mode, seconds)
                wall = time.perf_counter() - t0 - 0.2
                busy = _machine_busy() - c0
                waits = sampler.stop()
                if spec.notify_always:
                    gate.release(spec.table)
                n = res["count"]
                windows[mode].append(
                    {
                        "tx_per_s": n / seconds,
                        "p50_ms": pct(res["latencies"], 0.5) * 1e3,
                        "p99_ms": pct(res["latencies"], 0.99) * 1e3,
                        "machine_cpu_us_per_tx": busy / max(n, 1) * 1e6,
                        "cores_busy": busy / wall,
                        "waits": waits,
                    }
                )
            print(f"  {writers} writers: round {r + 1}/{rounds} done", flush=True)
    finally:
        pool.close()
        sampler.close()
        gate.close()
    base = [w["tx_per_s"] for w in windows["none"]]
    out = []
    for mode in modes:
        ws = windows[mode]
        rates = [w["tx_per_s"] for w in ws]
        # Paired per round: the ratio to the no-outbox window of the same round.
        ratios = [a / b for a, b in zip(rates, base, strict=True)]
        waits: Counter[str] = Counter()
        for w in ws:
            waits.update(w["waits"])
        out.append(
            {
                "writers": writers,
                "processes": pool.procs_n,
                "mode": mode,
                "diagnostic": MODES[mode].diagnostic,
                "tx_per_s": statistics.median(rates),
                "ratio_vs_none": round(statistics.median(ratios), 4),
                "ratios": [round(x, 4) for x in ratios],
                "p50_ms": round(statistics.median(w["p50_ms"] for w in ws), 3),
                "p99_ms": round(statistics.median(w["p99_ms"] for w in ws), 3),
                "machine_cpu_us_per_tx": round(
                    statistics.median(w["machine_cpu_us_per_tx"] for w in ws), 1
                ),
                "cores_busy": round(statistics.median(w["cores_busy"] for w in ws), 2),
                "waits": {k: round(v / len(ws), 4) for k, v in waits.most_common(8)},
                "windows": ws,
            }
        )
    return out


def gate_cost(dsn: str, n: int = 20000, repeat: int = 5) -> dict[str, float]:
    """Server time per transaction of the gate's try-lock and of a NOTIFY, against an empty
    transaction (a DO block committing ``n`` times; best of ``repeat``, interleaved)."""
    key = Statements("outbox").try_wake_lock.split("(", 1)[1].rstrip(")")
    body = {
        "empty transaction": "PERFORM 1",
        "wake-up gate (shared try-lock)": f"PERFORM pg_try_advisory_xact_lock_shared({key})",
        "pg_notify": "PERFORM pg_notify('outboxkit_bench_gate', '')",
    }
    best = dict.fromkeys(body, float("inf"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(repeat):
            for name, stmt in body.items():
                t0 = time.perf_counter()
                conn.execute(f"DO $$ BEGIN FOR i IN 1..{n} LOOP {stmt}; COMMIT; END LOOP; END $$")
                best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return {k: round(v, 2) for k, v in best.items()}


# -- the wake-up options: commit -> broker-ack latency (bench/latency.py's method) ----------

# name -> (writers notify, relay linger, relay poll_interval, gate held by a bystander,
#          the relay's first look again after work, in seconds)
WAKE_VARIANTS: dict[str, tuple[bool, float, float, bool, float]] = {
    # Before the gate: every commit notifies, the relay waits after every batch.
    "every commit notifies (before)": (True, 0.0, 1.0, True, 0.001),
    # The relay looks again after 1, 2, 4 ... ms for 30 ms after work; writers notify
    # only while it waits.
    "gated NOTIFY, linger 30 ms, first look 1 ms": (True, 0.03, 1.0, False, 0.001),
    "gated NOTIFY, linger 30 ms, first look 2 ms": (True, 0.03, 1.0, False, 0.002),
    "gated NOTIFY, linger 30 ms, first look 4 ms": (True, 0.03, 1.0, False, 0.004),
    "gated NOTIFY, linger 10 ms, first look 1 ms": (True, 0.01, 1.0, False, 0.001),
    # No NOTIFY at all: the relay polls the partial index every 5 ms when idle.
    "no NOTIFY, 5 ms polling": (False, 0.0, 0.005, False, 0.001),
}


async def _latency_run(
    dsn: str,
    bootstrap: str,
    rate: float,
    seconds: float,
    variant: tuple[bool, float, float, bool, float],
) -> dict[str, Any]:
    import asyncio

    import latency
    from _common import CpuMeter

    from outboxkit import Relay
    from outboxkit.publishers.kafka import KafkaPublisher
    from outboxkit.queue.loop import linger_waits
    from outboxkit.relay.polling import PollingSource

    notify, linger, poll, hold, first = variant
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    gate = GateHolder(dsn) if hold else None
    if gate is not None:
        gate.hold("outbox")
    publisher = latency.TimingPublisher(KafkaPublisher({"bootstrap.servers": bootstrap}))
    await publisher.start()
    relay = Relay(dsn, publisher, listen=notify, poll_interval=poll, linger=min(linger, poll))
    assert isinstance(relay._source, PollingSource)
    relay._source.loop._linger_waits = linger_waits(min(linger, poll), first)
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(1.0)  # connected and listening
    meter = CpuMeter()  # the machine, and this process: the relay and librdkafka
    meter.start()
    batches0 = relay.stats.batches
    listener = Listeners(dsn, ["outbox"])  # counts the commits that notified
    proc = mp.get_context("spawn").Process(target=latency.writer, args=(dsn, rate, seconds, notify))
    proc.start()
    expected = int(rate * seconds)
    deadline = time.monotonic() + seconds + 60
    while len(publisher.latencies) < expected and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    await asyncio.to_thread(proc.join)
    cpu = meter.stop(max(len(publisher.latencies), 1))
    batches = relay.stats.batches - batches0
    await asyncio.sleep(0.3)
    listener.close()
    relay.stop()
    await task
    if gate is not None:
        gate.close()
    lat = sorted(x * 1000 for x in publisher.latencies)
    return {
        "events": len(lat),
        "p50_ms": round(pct(lat, 0.5), 2),
        "p90_ms": round(pct(lat, 0.9), 2),
        "p99_ms": round(pct(lat, 0.99), 2),
        "max_ms": round(lat[-1], 2),
        "notifying_commits": listener.received,
        "events_per_claim": round(len(lat) / max(batches, 1), 2),
        "relay_cpu_us_per_event": round(cpu["us_per_event_client"], 1),
        "machine_cpu_us_per_event": round(cpu["us_per_event_total"], 1),
    }


def latency_variants(dsn: str, rate: float, seconds: float) -> dict[str, Any]:
    import asyncio

    from _common import ensure_topic, kafka_broker

    out: dict[str, Any] = {}
    with kafka_broker(None) as bootstrap:
        ensure_topic(bootstrap, "bench.latency")
        for name, variant in WAKE_VARIANTS.items():
            out[name] = asyncio.run(_latency_run(dsn, bootstrap, rate, seconds, variant))
            r = out[name]
            print(
                f"  latency {name:<44} p50 {r['p50_ms']:6.2f}  p99 {r['p99_ms']:6.2f}"
                f"  max {r['max_ms']:7.1f} ms  ({r['events']} events,"
                f" {r['events_per_claim']} per claim, relay {r['relay_cpu_us_per_event']} us,"
                f" machine {r['machine_cpu_us_per_event']} us CPU per event)",
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--quick", action="store_true", help="16 and 64 writers, 5 modes, 2 rounds")
    ap.add_argument("--writers", default=None, help="comma-separated writer counts (1,4,16,64)")
    ap.add_argument(
        "--modes", default=None, help=f"semicolon-separated subset of: {'; '.join(MODES)}"
    )
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None, help="length of one window")
    ap.add_argument("--diagnostics", action="store_true", help="add the attribution-only modes")
    ap.add_argument(
        "--latency",
        action="store_true",
        help="also commit -> Kafka ack latency of each wake-up option at 1 000 events/s",
    )
    ap.add_argument("--latency-seconds", type=float, default=None)
    ap.add_argument(
        "--latency-only", action="store_true", help="only the wake-up options' latency runs"
    )
    ap.add_argument("--rate", type=float, default=1000.0, help="events/s of the latency runs")
    ap.add_argument("--name", default="concurrent_writers", help="results file name")
    ap.add_argument(
        "--no-relay",
        action="store_true",
        help="no relay draining the outbox (default: one, library defaults, confirming at once)",
    )
    args = ap.parse_args()
    default_writers = "16,64" if args.quick else "1,4,16,64"
    writers = [int(x) for x in (args.writers or default_writers).split(",")]
    if args.modes:
        modes = [m.strip() for m in args.modes.split(";")]
    elif args.quick:
        modes = [m for m in QUICK_MODES if m in MODES]
    else:
        modes = [m for m, spec in MODES.items() if args.diagnostics or not spec.diagnostic]
    if "none" not in modes:
        modes.insert(0, "none")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown mode(s) {unknown}; known: {list(MODES)}")
    rounds = args.rounds or (2 if args.quick else 6)
    seconds = args.seconds or (1.5 if args.quick else 2.0)

    tables = setup(args.dsn, modes)
    cost = gate_cost(args.dsn, n=5000 if args.quick else 20000)
    print(f"server time per transaction (us, best of 5): {cost}", flush=True)
    # A LISTEN session per table, so a NOTIFY always has someone to signal; and the relay.
    listeners = Listeners(args.dsn, tables)
    relay = None if args.no_relay else RelayProcess(args.dsn, "outbox")
    results: list[dict[str, Any]] = []
    started = time.time()
    try:
        for n in [] if args.latency_only else writers:
            results += measure(args.dsn, n, modes, rounds, seconds, tables)
    finally:
        listeners.close()
        if relay is not None:
            relay.close()
    elapsed = time.time() - started
    wake: dict[str, Any] = {}
    if args.latency or args.latency_only:
        wake = latency_variants(
            args.dsn, args.rate, args.latency_seconds or (10.0 if args.quick else 30.0)
        )

    print(
        f"\n{'writers':>7} {'mode':<44} {'tx/s':>8} {'vs none':>8} {'p50 ms':>7} {'p99 ms':>7}"
        f" {'CPU us/tx':>9}  top waits"
    )
    for r in results:
        top = ", ".join(f"{k} {v:.0%}" for k, v in list(r["waits"].items())[:4])
        print(
            f"{r['writers']:>7} {r['mode']:<44} {r['tx_per_s']:>8.0f} {r['ratio_vs_none']:>8.3f}"
            f" {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['machine_cpu_us_per_tx']:>9.0f}  {top}"
        )
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
    save(
        args.name,
        {
            "rounds": rounds,
            "window_s": seconds,
            "elapsed_s": round(elapsed, 1),
            "cores": os.cpu_count(),
            "loadavg_end": os.getloadavg(),
            "server_version": version[0] if version else None,
            "notifications_received": listeners.received,
            "relay": not args.no_relay,
            "wake_latency": wake,
            "server_us_per_transaction": cost,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
