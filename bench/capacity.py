"""Check the capacity model of docs/capacity.md: fit on one relay, predict a fleet, measure it.

    python bench/capacity.py --dsn postgresql://postgres@127.0.0.1:5432/postgres \
        [--broker nats|kafka|redis] [--events 30000] [--databases 6] [--processes 2]

``--dsn`` is only used to create (and at the end drop) databases of this benchmark's own,
``capacity_bench_0`` ...; nothing runs in the database it names.

**Fit** (one database, one ``outboxkit relay --dsn``; NATS JetStream, Kafka (an
embedded Tansu broker, as the other benchmarks use) or Redis Streams): the relay runs idle
for a few seconds (its idle CPU per second), then ``events`` rows are inserted (and analyzed)
in one transaction and the relay drains them. The CPU of the window, less the idle rate times the
window, over the events, is the relay's CPU per event; the same for each PostgreSQL backend
the relay holds, grouped by ``application_name`` (the claim, the settle...): the
database's CPU per event for the claim and for the settle.

**Fit of the idle cost**: one fleet process (``--dsn-file``) over the ``databases``
databases, idle: its CPU per database per second (the lease checks, a connection each).

**Check** (a configuration not used to fit: ``processes`` fleet processes, ``--dsn-file``
over ``databases`` databases, busy): predicted CPU = events x the fit's CPU per event +
databases x the idle cost per database x the window; measured = the CPU the processes (and
their backends) used over the window. Comparing CPU, not wall rates, holds on a shared
2-core machine where other load slows every process alike: a relay that is kept off the
core uses no CPU either. The wall rates are reported too.

Why windows on a running process instead of two lives (bench/_measure.py): a fleet process
takes its databases over a few lease rounds; loading the rows once the ownership has
settled keeps start-up, connecting and the hand-over out of the window without a second run.
What this leaves out: PostgreSQL's WAL writer and checkpointer (no backend of the relay's),
and the broker's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import psycopg
from _common import ensure_topic, kafka_broker, prepare, save, server_facts

STREAM = "CAPACITY_BENCH"
TOPIC = "capacity.orders"
PREFIX = "capacity_bench_"
REDIS_PREFIX = "capacity_bench:"
_COLUMNS = "event_id, topic, key, event_type, aggregate_type, aggregate_id, payload, headers"


def _dsn(admin: str, name: str) -> str:
    parts = psycopg.conninfo.conninfo_to_dict(admin)
    parts["dbname"] = name
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in parts.items() if v is not None})


def create_databases(admin: str, count: int, events: int) -> list[str]:
    """``count`` fresh databases with the outbox table and a seed of ``events`` rows."""
    names = [f"{PREFIX}{i}" for i in range(count)]
    drop_databases(admin, count + 8)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {names[0]}")
    prepare(_dsn(admin, names[0]), events)  # (its connections are closed on return)
    with psycopg.connect(admin, autocommit=True) as conn:
        for name in names[1:]:
            conn.execute(f"CREATE DATABASE {name} TEMPLATE {names[0]}")
    return [_dsn(admin, n) for n in names]


def drop_databases(admin: str, count: int) -> None:
    with psycopg.connect(admin, autocommit=True) as conn:
        for i in range(count):
            conn.execute(f"DROP DATABASE IF EXISTS {PREFIX}{i} WITH (FORCE)")


def load(dsn: str, n: int) -> None:
    """Insert ``n`` seed rows in one transaction (the relay drains them), analyzed in it: a
    relay's claim planned on the empty table's statistics scans the whole backlog per batch
    (measured: 221 µs of PostgreSQL CPU per event instead of ~25), which a table written
    to steadily, with autovacuum, never sees."""
    cols = _COLUMNS.replace("topic", "%s AS topic")
    with psycopg.connect(dsn) as conn:
        conn.execute(
            f"INSERT INTO outbox ({_COLUMNS}) SELECT {cols} FROM bench_seed LIMIT {int(n)}",
            (TOPIC,),
        )
        conn.execute("ANALYZE outbox")
        conn.commit()


def left(conns: list[psycopg.Connection[Any]]) -> int:
    total = 0
    for conn in conns:
        row = conn.execute("SELECT count(*) FROM outbox").fetchone()
        total += int(row[0]) if row else 0
    return total


def _cpu(pid: int) -> float:
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    return 0.0


class Meter:
    """CPU seconds of the relay processes and, by ``application_name``, of the PostgreSQL
    backends connected to the benchmark's databases."""

    def __init__(self, admin: str, pids: list[int], names: list[str]) -> None:
        self.admin = psycopg.connect(admin, autocommit=True)
        self.pids = pids
        self.names = names

    def backends(self) -> dict[int, str]:
        rows = self.admin.execute(
            "SELECT pid, application_name FROM pg_stat_activity"
            " WHERE datname = ANY(%s) AND application_name LIKE 'outboxkit%%'",
            (self.names,),
        ).fetchall()
        return {int(pid): str(app) for pid, app in rows}

    def database_stats(self) -> tuple[int, int]:
        """Transactions committed or rolled back in the benchmark's databases (as the
        statistics collector has them, flushed within a second; the relays' own: this
        benchmark runs none while it measures idle), and connections held."""
        row = self.admin.execute(
            "SELECT coalesce(sum(xact_commit + xact_rollback), 0), coalesce(sum(numbackends), 0)"
            " FROM pg_stat_database WHERE datname = ANY(%s)",
            (self.names,),
        ).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def read(self) -> dict[str, Any]:
        backends = self.backends()
        xacts, _all = self.database_stats()
        return {
            "t": time.perf_counter(),
            "xacts": xacts,
            "connections": len(backends),  # the relays' (not this benchmark's own)
            "relay": {pid: _cpu(pid) for pid in self.pids},
            "pg": {pid: (app, _cpu(pid)) for pid, app in backends.items()},
        }

    @staticmethod
    def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        """CPU used between readings ``a`` and ``b``: the relays' total and each process's,
        the backends' by ``application_name`` (a backend that started in between counts
        from 0; one that ended in between is lost: the fleet's short lease connections)."""
        by_app: dict[str, float] = {}
        for pid, (app, cpu) in b["pg"].items():
            before = a["pg"].get(pid, (app, 0.0))[1]
            key = app.split(":", 1)[1] if ":" in app else app
            by_app[key] = by_app.get(key, 0.0) + cpu - before
        per_process = [b["relay"][p] - a["relay"][p] for p in b["relay"]]
        return {
            "seconds": b["t"] - a["t"],
            "transactions": b["xacts"] - a["xacts"],
            "connections": b["connections"],
            "relay_cpu_s": sum(per_process),
            "relay_cpu_s_per_process": per_process,
            "pg_cpu_s": sum(by_app.values()),
            "pg_cpu_s_by_connection": by_app,
        }


def start_relays(
    args: list[list[str]], broker: str, logs: Path, src: str | None
) -> list[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOXKIT_")}
    if src:
        env["PYTHONPATH"] = src
    out = []
    for i, extra in enumerate(args):
        cmd = [sys.executable, "-m", "outboxkit", "relay", "--broker", broker, *extra]
        cmd += ["--log-level", "warning"]
        with (logs / f"relay-{i}.log").open("ab") as log:
            out.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    return out


def stop_relays(processes: list[subprocess.Popen[bytes]]) -> None:
    for p in processes:
        p.send_signal(signal.SIGTERM)
    for p in processes:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def run(
    admin: str,
    dsns: list[str],
    relay_args: list[list[str]],
    broker: str,
    events: int,
    idle_s: float,
    settle_s: float,
    src: str | None,
) -> dict[str, Any]:
    """Start the relays, wait ``settle_s``, measure ``idle_s`` idle, load ``events`` rows in
    every database, measure until they are all published and deleted (no ``events``: only
    the idle measure)."""
    names = [str(psycopg.conninfo.conninfo_to_dict(d)["dbname"]) for d in dsns]
    logs = Path(tempfile.mkdtemp(prefix="outboxkit-capacity-"))
    processes = start_relays(relay_args, broker, logs, src)
    conns = [psycopg.connect(d, autocommit=True) for d in dsns]
    try:
        time.sleep(settle_s)
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"a relay exited; see {logs}")
        meter = Meter(admin, [p.pid for p in processes], names)
        t0 = meter.read()
        time.sleep(idle_s)
        t1 = meter.read()
        if not events:
            return {"databases": len(dsns), "processes": len(processes), "idle": meter.diff(t0, t1)}
        load_start = time.perf_counter()
        for dsn in dsns:
            load(dsn, events)
        loaded = time.perf_counter()
        deadline = loaded + 150
        while left(conns) and time.perf_counter() < deadline:
            time.sleep(0.05)
        if left(conns):
            raise RuntimeError(f"not drained in 150 s; see {logs}")
        t2 = meter.read()
        idle = Meter.diff(t0, t1)
        busy = Meter.diff(t1, t2)
        total = events * len(dsns)
        return {
            "databases": len(dsns),
            "processes": len(processes),
            "events": total,
            "load_s": loaded - load_start,
            "idle": idle,
            "busy": busy,
            # from the first INSERT's start: the relays drain while the later ones load
            "wall_rate": total / (t2["t"] - load_start),
            "logs": str(logs),
        }
    finally:
        for c in conns:
            c.close()
        stop_relays(processes)


def per_event(result: dict[str, Any]) -> dict[str, Any]:
    """µs per event of the busy window, less the idle rate over it."""
    idle, busy, n = result["idle"], result["busy"], result["events"]
    relay_idle_rate = idle["relay_cpu_s"] / idle["seconds"]
    pg_idle_rate = idle["pg_cpu_s"] / idle["seconds"]
    out = {
        "relay_us": (busy["relay_cpu_s"] - relay_idle_rate * busy["seconds"]) * 1e6 / n,
        "pg_us": (busy["pg_cpu_s"] - pg_idle_rate * busy["seconds"]) * 1e6 / n,
        "relay_idle_cpu_s_per_s": relay_idle_rate,
        "pg_idle_cpu_s_per_s": pg_idle_rate,
    }
    out["pg_us_by_connection"] = {k: v * 1e6 / n for k, v in busy["pg_cpu_s_by_connection"].items()}
    return out


def _delete_stream(url: str | None) -> None:
    """Drop the benchmark's JetStream stream (its messages are not needed)."""
    if url is None:
        return

    async def delete() -> None:
        import nats

        nc = await nats.connect(url)
        try:
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_stream(STREAM)
        finally:
            await nc.close()

    asyncio.run(delete())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True, help="admin DSN: databases are created through it")
    ap.add_argument("--broker", choices=("nats", "kafka", "redis"), default="nats")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--nats", default="nats://127.0.0.1:4222")
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka (default: embedded Tansu)")
    ap.add_argument("--events", type=int, default=30_000, help="events per database")
    ap.add_argument("--fit-events", type=int, help="events of the fit (default: events x 2)")
    ap.add_argument("--databases", type=int, default=6)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of idle measured")
    ap.add_argument("--src", help="PYTHONPATH of the relays (default: inherited)")
    ap.add_argument("--out", help="results name (default: capacity, capacity_kafka)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if args.broker == "kafka":
            bootstrap = stack.enter_context(kafka_broker(args.kafka))
            ensure_topic(bootstrap, TOPIC)
            broker = f"kafka://{bootstrap}"
        elif args.broker == "redis":  # a stream of its own, trimmed, deleted at the end
            broker = f"{args.redis}?stream_prefix={REDIS_PREFIX}&maxlen=10000"
            stack.callback(_delete_redis_stream, args.redis)
        else:
            broker = f"{args.nats}?stream={STREAM}&subjects=capacity.>"
        measure(args, broker)


def _delete_redis_stream(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    client.delete(f"{REDIS_PREFIX}{TOPIC}")
    client.close()


def measure(args: argparse.Namespace, broker: str) -> None:
    src = args.src or os.environ.get("PYTHONPATH")
    fit_events = args.fit_events or args.events * 2
    nats_url = args.nats if args.broker == "nats" else None
    _delete_stream(nats_url)
    dsns = create_databases(args.dsn, args.databases, max(fit_events, args.events))
    try:
        print("fit: 1 relay, 1 database", flush=True)
        fit = run(args.dsn, dsns[:1], [["--dsn", dsns[0]]], broker, fit_events, args.idle, 4, src)
        model = per_event(fit)
        print({k: v for k, v in model.items()}, flush=True)
        _delete_stream(nats_url)

        dsn_file = Path(tempfile.mkdtemp(prefix="outboxkit-capacity-")) / "databases"
        dsn_file.write_text("".join(f"db{i} {d}\n" for i, d in enumerate(dsns)))
        fleet = ["--dsn-file", str(dsn_file), "--fleet-lease", "3", "--reload-interval", "600"]
        # The fleet's cost per idle database (its lease checks: a connection per database
        # and round), fitted on one idle process: the check's processes pay it per database.
        print(f"fit: 1 fleet process, {args.databases} idle databases", flush=True)
        idle_fit = run(args.dsn, dsns, [fleet], broker, 0, args.idle, 12, src)["idle"]
        model["fleet_idle_relay_cpu_s_per_db_s"] = (
            idle_fit["relay_cpu_s"] / idle_fit["seconds"] / args.databases
        )
        model["fleet_idle_pg_cpu_s_per_db_s"] = (
            idle_fit["pg_cpu_s"] / idle_fit["seconds"] / args.databases
        )
        model["fleet_idle_transactions_per_db_s"] = (
            idle_fit["transactions"] / idle_fit["seconds"] / args.databases
        )
        print(f"check: {args.processes} fleet processes, {args.databases} databases", flush=True)
        check = run(
            args.dsn,
            dsns,
            [fleet] * args.processes,
            broker,
            args.events,
            args.idle,
            12,
            src,
        )
        _delete_stream(nats_url)
    finally:
        drop_databases(args.dsn, args.databases)

    busy = check["busy"]
    n = check["events"]
    # the prediction uses the fits only (docs/capacity.md's formula): CPU per event times
    # the events, plus the fleet's cost per database over the window
    dbs_s = args.databases * busy["seconds"]
    predicted_relay = n * model["relay_us"] / 1e6 + model["fleet_idle_relay_cpu_s_per_db_s"] * dbs_s
    predicted_pg = n * model["pg_us"] / 1e6 + model["fleet_idle_pg_cpu_s_per_db_s"] * dbs_s
    measured = per_event(check)
    idle = check["idle"]
    comparison = {
        "relay_cpu_s": {
            "predicted": predicted_relay,
            "measured": busy["relay_cpu_s"],
            "error": busy["relay_cpu_s"] / predicted_relay - 1,
        },
        "pg_cpu_s": {
            "predicted": predicted_pg,
            "measured": busy["pg_cpu_s"],
            "error": busy["pg_cpu_s"] / predicted_pg - 1,
        },
        "relay_plus_pg_cpu_s": {
            "predicted": predicted_relay + predicted_pg,
            "measured": busy["relay_cpu_s"] + busy["pg_cpu_s"],
            "error": (busy["relay_cpu_s"] + busy["pg_cpu_s"]) / (predicted_relay + predicted_pg)
            - 1,
        },
        # rates: what the fit's CPU per event allows on the cores the run got
        "wall_rate": {
            "fit": fit["wall_rate"],
            "check": check["wall_rate"],
            "check_cpu_bound_on_2_cores": 2e6 / (model["relay_us"] + model["pg_us"]),
        },
        "fleet_idle_per_database": {
            "connections": idle["connections"] / args.databases,
            "transactions_per_s": idle["transactions"] / idle["seconds"] / args.databases,
            "relay_cpu_ms_per_s": idle["relay_cpu_s"] / idle["seconds"] / args.databases * 1e3,
            "pg_cpu_ms_per_s": idle["pg_cpu_s"] / idle["seconds"] / args.databases * 1e3,
        },
    }
    within = all(abs(comparison[k]["error"]) <= 0.25 for k in ("relay_cpu_s", "pg_cpu_s"))
    print(comparison, "within 25 %:", within, flush=True)
    save(
        args.out or ("capacity" if args.broker == "nats" else f"capacity_{args.broker}"),
        {
            "server": server_facts(args.dsn),
            "load_average": os.getloadavg(),
            "broker": args.broker,
            "fit": {
                "config": "1 outboxkit relay --dsn, 1 database; 1 idle fleet process",
                "result": fit,
                "idle_fleet": idle_fit,
                "model": model,
            },
            "check": {
                "config": f"{args.processes} relay --dsn-file, {args.databases} databases",
                "result": check,
                "per_event": measured,
            },
            "comparison": comparison,
            "within_25_percent": within,
        },
    )


if __name__ == "__main__":
    main()
