"""Fairness between a fleet's databases: does a database draining a big backlog delay another's?

One ``outboxkit relay --dsn-file`` process over two databases of a private embedded
PostgreSQL (fsync off), to a private nats-server (JetStream, file store). Database B gets a
writer committing one event per transaction at ``--rate`` events/s, each carrying the
wall-clock time taken just before its COMMIT; a core NATS subscription in this process on
B's subject reads each message as the server routes it, and records receive time - stamp
(commit -> broker, the commit's own duration included). Phases in the same run:

* ``alone``: database A is empty;
* ``flood``: database A holds ``--backlog`` events, inserted in one statement (one commit,
  so the whole backlog is claimable at once), and the relay drains them while B writes;
* ``flood_split``: the same flood, A and B each relayed by a process of its own (a one-line
  file each): what sharing one process (one event loop) costs B.

The phases take turns ``--rounds`` times (the relays restarted and A's leftover backlog
deleted between phases), so machine noise hits all alike. A's drain rate during the window
and the relays' CPU are reported beside B's percentiles; ``--profile`` records py-spy's
stacks of the fleet process in each flood window.

    python bench/fleet_fairness.py [--backlog 1000000] [--rate 20] [--seconds 30] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from _common import save, server_facts

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.testing import EmbeddedNats, EmbeddedPostgres

STAMP = "x-bench-commit-stamp"
SUBJECT_A, SUBJECT_B = "fair.a", "fair.b"
ROOT = Path(__file__).resolve().parents[1]
PHASES = ("alone", "flood", "flood_split")

#: A's backlog: ~300-byte JSON bodies like bench/_common.py's, written by the server.
LOAD = """
INSERT INTO outbox (event_id, topic, key, event_type, aggregate_type, aggregate_id, payload)
SELECT gen_random_uuid(), %s, 'customer-' || lpad((i %% 1000)::text, 4, '0'), 'order.placed',
       'order', i::text,
       convert_to(json_build_object('order_id', i, 'customer', 'customer-' || (i %% 1000),
           'currency', 'EUR', 'total_cents', 1000 + i %% 9000,
           'lines', json_build_array(
               json_build_object('sku', 'SKU-' || (i * 7 %% 5000), 'qty', 1, 'price_cents', 499),
               json_build_object('sku', 'SKU-' || (i * 7 %% 5000 + 1), 'qty', 2,
                                 'price_cents', 500)),
           'shipping', json_build_object('method', 'standard', 'country', 'DE'),
           'note', 'gift wrap please')::text, 'UTF8')
FROM generate_series(1, %s) AS i
"""


def writer(dsn: str, rate: float, seconds: float) -> None:
    """One event per transaction on a fixed schedule (no catch-up bursts)."""
    outbox = Outbox()
    with psycopg.connect(dsn) as conn:
        t0 = time.perf_counter()
        for i in range(int(rate * seconds)):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with conn.transaction():
                event = Event(
                    topic=SUBJECT_B,
                    event_type="order.placed",
                    payload={"order_id": i, "note": "the quiet database"},
                    key=f"customer-{i % 100}",
                    headers={STAMP: repr(time.time())},
                )
                outbox.put(conn, event)


def pending(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox WHERE status = 0").fetchone()
    return int(row[0]) if row else 0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Relay:
    """The one ``outboxkit relay --dsn-file`` process."""

    def __init__(self, dsn_file: Path, broker: str, log: Path, extra: list[str]) -> None:
        self.command = [sys.executable, "-m", "outboxkit", "relay", "--dsn-file", str(dsn_file)]
        self.command += ["--broker", broker, "--log-level", "warning", *extra]
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def stop(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def cpu(self) -> float:
        """The relay process's CPU seconds so far (user + system)."""
        assert self.process is not None
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def window(
    nats_url: str,
    dsn_a: str,
    dsn_b: str,
    relays: list[Relay],
    rate: float,
    seconds: float,
    profile: Path | None = None,
) -> dict[str, Any]:
    """B writes for ``seconds`` while this process reads B's subject: B's latencies, and
    how many of A's events the relay published meanwhile."""
    import nats

    latencies: list[float] = []

    async def received(msg: Any) -> None:
        now = time.time()
        stamp = (msg.headers or {}).get(STAMP)
        if stamp is not None:
            latencies.append(now - float(stamp))

    nc = await nats.connect(nats_url)
    await nc.subscribe(SUBJECT_B, cb=received)
    a_before, cpu_before = pending(dsn_a), sum(r.cpu() for r in relays)
    started = time.monotonic()
    proc = multiprocessing.get_context("spawn").Process(target=writer, args=(dsn_b, rate, seconds))
    proc.start()
    spy = None
    if profile is not None:  # (py-spy's collapsed stacks of the relay process over the window)
        spy = await asyncio.create_subprocess_exec(
            "py-spy", "record", "--pid", str(relays[0].pid), "--format", "raw",
            "--duration", str(int(seconds)), "--output", str(profile), "--nonblocking",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    await asyncio.to_thread(proc.join)
    if spy is not None:
        await spy.wait()
    took = time.monotonic() - started
    a_after, cpu_after = pending(dsn_a), sum(r.cpu() for r in relays)
    expected = int(rate * seconds)
    deadline = time.monotonic() + 60
    while len(latencies) < expected and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    await nc.close()
    ms = [x * 1000 for x in latencies]
    return {
        "b_events": len(ms),
        "b_expected": expected,
        "b_p50_ms": round(pct(ms, 0.50), 1),
        "b_p90_ms": round(pct(ms, 0.90), 1),
        "b_p99_ms": round(pct(ms, 0.99), 1),
        "b_max_ms": round(max(ms), 1),
        "b_mean_ms": round(statistics.fmean(ms), 1),
        "a_pending_at_start": a_before,
        "a_published_per_s": round((a_before - a_after) / took),
        "relay_cpu_share": round((cpu_after - cpu_before) / took, 2),
    }


def load_backlog(dsn: str, n: int) -> float:
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LOAD, (SUBJECT_A, n))
    return time.monotonic() - started


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import nats
    from nats.js.api import StorageType, StreamConfig

    work = Path(tempfile.mkdtemp(prefix="fleet-fairness-"))
    server = EmbeddedPostgres(fsync=False, settings={"max_connections": "100"})
    broker = EmbeddedNats(work / "nats")
    server.start()
    broker.start()
    try:
        dsns = []
        for name in ("a", "b"):
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE fair_{name}")
            dsns.append(server.dsn_for(f"fair_{name}"))
            migrate(dsns[-1], table="outbox")
        dsn_a, dsn_b = dsns
        nc = await nats.connect(broker.url)
        # (a file stream capped at 200 000 messages: the backlog need not be kept)
        await nc.jetstream().add_stream(
            StreamConfig(
                name="FAIR",
                subjects=["fair.>"],
                max_msgs=200_000,
                storage=StorageType.FILE,
            )
        )
        await nc.close()
        files = {"both": work / "databases", "a": work / "a", "b": work / "b"}
        files["both"].write_text(f"a {dsn_a}\nb {dsn_b}\n")
        files["a"].write_text(f"a {dsn_a}\n")
        files["b"].write_text(f"b {dsn_b}\n")
        phases: list[dict[str, Any]] = []
        loads: list[float] = []
        for i in range(args.rounds):
            for phase in PHASES:
                if phase != "alone":
                    loads.append(load_backlog(dsn_a, args.backlog))
                    print(f"round {i + 1}: {args.backlog} events in A in {loads[-1]:.1f} s")
                # flood_split: one process per database, for comparison with the fleet's one
                names = ["a", "b"] if phase == "flood_split" else ["both"]
                relays = [
                    Relay(files[n], broker.url, work / f"relay-{n}.log", args.relay_args)
                    for n in names
                ]
                for relay in relays:
                    relay.start()
                await asyncio.sleep(args.warmup)  # connected, listening, A's drain under way
                profile = None
                if args.profile and phase == "flood":
                    profile = Path(args.profile).with_suffix(f".{i + 1}.txt")
                result = await window(
                    broker.url, dsn_a, dsn_b, relays, args.rate, args.seconds, profile
                )
                for relay in relays:
                    relay.stop()
                with psycopg.connect(dsn_a, autocommit=True) as conn:
                    conn.execute("TRUNCATE outbox")
                with psycopg.connect(dsn_b, autocommit=True) as conn:
                    conn.execute("DELETE FROM outbox WHERE status <> 0")
                result = {"round": i + 1, "phase": phase, **result}
                print(result)
                phases.append(result)
        facts = server_facts(dsn_a)
    finally:
        broker.close()
        server.close()
    summary = {}
    for phase in PHASES:
        runs = [p for p in phases if p["phase"] == phase]
        summary[phase] = {
            key: round(statistics.median(p[key] for p in runs), 1)
            for key in ("b_p50_ms", "b_p99_ms", "b_max_ms", "a_published_per_s", "relay_cpu_share")
        }
    return {"phases": phases, "summary": summary, "backlog_load_s": loads, "server": facts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backlog", type=int, default=1_000_000)
    ap.add_argument("--rate", type=float, default=20.0, help="B's events/s")
    ap.add_argument("--seconds", type=float, default=30.0, help="B's writing window")
    ap.add_argument("--warmup", type=float, default=3.0, help="relay start to B's first write")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", help="py-spy's raw stacks of the relay in each flood window")
    ap.add_argument("--quick", action="store_true", help="100 000 events, 10 s, one round")
    ap.add_argument(
        "--relay-arg", dest="relay_args", action="append", default=[],
        help="an extra argument of `outboxkit relay` (repeat it): --relay-arg=--batch-size=200",
    )  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        args.backlog, args.seconds, args.rounds = 100_000, 10.0, 1
    result = asyncio.run(run(args))
    save(
        "fleet_fairness",
        {
            "command": " ".join(["python", "bench/fleet_fairness.py", *sys.argv[1:]]),
            "backlog": args.backlog,
            "rate": args.rate,
            "seconds": args.seconds,
            "relay_args": args.relay_args,
            **result,
        },
    )
    print(result["summary"])


if __name__ == "__main__":
    main()
