"""``outboxkit relay`` at the steady rates production runs: CPU per event and commit → broker.

Issue 42, item 1. Writer processes commit one event per transaction at a paced rate (split
over ``--writers`` processes, each on its own schedule, no catch-up bursts), each event
stamped with the wall-clock time just before its COMMIT. One ``outboxkit relay`` process,
as users start it (its defaults), publishes to an embedded Kafka (Tansu); a consumer in
this process reads the topic and records receive time - stamp (commit → broker → consumer,
so a slight overstatement of commit → broker). Over the measured window (the writers' run,
until the consumer has every event) it reads:

* the relay process's CPU (psutil: user + system, every thread);
* the CPU of the relay's own PostgreSQL backends (found by application name in
  pg_stat_activity; the writers' backends are not counted), i.e. the claim and settle;

each divided by the events. ``--drain`` adds the same relay draining a preloaded backlog of
as many events as the highest rate's run, for "the cost per event when draining".
``--variant NAME=SRC`` runs the relay from another src tree too (an A/B, interleaved).

    cd bench && PYTHONPATH=../src:. python relay_steady.py --dsn postgresql://... \\
        --rates 50 500 5000 --seconds 10 --drain --variant before=/tmp/base/src
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import psycopg
from _common import ensure_topic, kafka_broker, make_event, save, server_facts

from outboxkit import Outbox, migrate
from outboxkit.testing import spawn_relay

TOPIC = "bench.steady"
STAMP = "x-bench-commit-stamp"


def writer(dsn: str, rate: float, seconds: float, start: float, run: str) -> None:
    topic = f"{TOPIC}.{run}"
    """One event per transaction at ``rate``/s from wall time ``start`` (no catch-up)."""
    outbox = Outbox()
    total = int(rate * seconds)
    with psycopg.connect(dsn) as conn:
        for i in range(total):
            delay = start + i / rate - time.time()
            if delay > 0:
                time.sleep(delay)
            with conn.transaction():
                event = make_event(i, topic=topic, headers={STAMP: f"{run} {time.time()!r}"})
                outbox.put(conn, event)


class Consumer(threading.Thread):
    """Reads the run's own topic from its start; receive time - commit stamp per event.

    Each run publishes to a topic of its own and stamps its events with its id. One topic
    for every run broke the count: after a burst, the broker's high watermark lagged what
    it had taken, so a consumer started there read the previous run's tail (a run "done" at
    once with 0 CPU and 477 ms latencies), and past some tens of thousands of messages the
    embedded broker's consumer side stalled while the relay's publishes were all confirmed
    ("14 of 40 000 events reached the broker")."""

    def __init__(self, bootstrap: str, run: str) -> None:
        super().__init__(daemon=True)
        self.run_id = run
        from confluent_kafka import Consumer as KafkaConsumer

        self.consumer = KafkaConsumer({
            "bootstrap.servers": bootstrap, "group.id": f"steady-{time.time_ns()}",
            "auto.offset.reset": "earliest", "enable.auto.commit": False,
            "fetch.wait.max.ms": 2, "fetch.min.bytes": 1,  # (its default waits 500 ms)
        })  # fmt: skip
        from confluent_kafka import TopicPartition

        topic = f"{TOPIC}.{run}"
        self.consumer.assign([TopicPartition(topic, 0, 0)])
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.assigned = threading.Event()
        self.assigned.set()

    def run(self) -> None:
        while not self.stop.is_set():
            first = self.consumer.poll(0.05)  # (consume() would wait its whole timeout)
            if first is None:
                continue
            now = time.time()
            messages = [first, *self.consumer.consume(num_messages=999, timeout=0)]
            for message in messages:
                if message.error():
                    continue
                for name, value in message.headers() or []:
                    if name.endswith(STAMP) and value:
                        run, _, stamp = value.decode().partition(" ")
                        if run == self.run_id:
                            self.latencies.append(now - float(stamp))
        self.consumer.close()


def relay_backends(dsn: str) -> dict[int, str]:
    """The relay's backends: pid -> its role (the application name's tail: claim, settle,
    listen, gate). In this database only: other relays on the server (another benchmark's,
    a test's) are not this one's."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, application_name FROM pg_stat_activity"
            " WHERE application_name LIKE 'outboxkit-relay%%' AND datname = current_database()"
        ).fetchall()
    return {int(pid): str(name).rpartition(":")[2] for pid, name in rows}


class BackendMeter:
    """The CPU of the relay's PostgreSQL backends over a window (the server is local).

    Backends come and go: the settle connection opens at the first settle on its own and
    closes after a minute unused (a relay whose claims carry its settles barely uses it).
    ``sample()`` (called through the run) finds new ones, counted from zero (their start
    is the relay's cost too), and keeps each one's last reading, so one that exits
    mid-run keeps what it used."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.role: dict[int, str] = {}

    def start(self) -> None:
        self.role = relay_backends(self.dsn)
        for pid in self.role:
            self.first[pid] = self.last[pid] = _cpu(pid) or 0.0

    def sample(self) -> None:
        now = relay_backends(self.dsn)
        self.role |= now
        for pid in {*now, *self.last}:
            cpu = _cpu(pid)
            if cpu is not None:
                self.first.setdefault(pid, 0.0)
                self.last[pid] = cpu

    def used(self) -> float:
        return sum(self.last[pid] - self.first[pid] for pid in self.last)

    def by_role(self) -> dict[str, float]:
        """CPU seconds by backend role (claim, settle, listen, gate)."""
        out: dict[str, float] = {}
        for pid in self.last:
            role = self.role.get(pid, "?")
            out[role] = out.get(role, 0.0) + self.last[pid] - self.first[pid]
        return out


def _cpu(pid: int) -> float | None:
    """A backend's CPU seconds: /proc/<pid>/schedstat's run time, in nanoseconds (stat's
    user + system ticks are 10 ms apart, as much as a few hundred claims cost)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def one_run(
    dsn: str, bootstrap: str, src: str | None, rate: float | None, seconds: float, backlog: int
) -> dict[str, Any]:
    """One life of the relay: at ``rate`` for ``seconds``, or (rate None) draining ``backlog``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    run = uuid.uuid4().hex[:12]
    ensure_topic(bootstrap, f"{TOPIC}.{run}")
    consumer = Consumer(bootstrap, run)
    consumer.start()
    if not consumer.assigned.wait(30):
        raise RuntimeError("the consumer got no partition")
    log = Path(tempfile.gettempdir()) / "outboxkit-bench-steady.log"
    relay = spawn_relay(dsn, f"kafka://{bootstrap}", log, log_level=None,
                        env={"PYTHONPATH": src} if src else None)  # fmt: skip
    proc = psutil.Process(relay.pid)
    deadline = time.monotonic() + 30
    while not relay_backends(dsn) and time.monotonic() < deadline:  # its claim connection
        time.sleep(0.2)
    expected = backlog if rate is None else int(rate * seconds)
    time.sleep(1.0)  # idle: its start-up is over
    meter = BackendMeter(dsn)
    relay_before = sum(proc.cpu_times()[:2])
    meter.start()
    started = time.time()
    if rate is None:  # the backlog, committed at once while it waits (stamps: not the point)
        outbox = Outbox()
        with psycopg.connect(dsn) as conn, conn.transaction():
            for start in range(0, backlog, 5000):
                events = [make_event(i, topic=f"{TOPIC}.{run}",
                                     headers={STAMP: f"{run} {time.time()!r}"})
                          for i in range(start, min(backlog, start + 5000))]  # fmt: skip
                outbox.put_many(conn, events)
    writers: list[multiprocessing.Process] = []
    begin = time.time()
    if rate is not None:
        count = max(1, min(8, int(rate // 400) + 1))
        begin = time.time() + 0.5
        for _ in range(count):
            w = multiprocessing.Process(
                target=writer, args=(dsn, rate / count, seconds, begin, run)
            )
            w.start()
            writers.append(w)
        expected = count * int(rate / count * seconds)
    deadline = time.monotonic() + seconds + 120
    published_at: float | None = None
    written_at: float | None = None  # the writers' last commit (about)
    sampled = time.monotonic()
    while len(consumer.latencies) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
        if time.monotonic() - sampled > 0.5:
            meter.sample()
            sampled = time.monotonic()
        # The database's side: every event written and none left in the outbox means the
        # relay had every one confirmed by the broker. The consumer gets 2 s more; past that
        # the run ends and says what the consumer missed (Tansu's consumer side has stalled
        # here under load while the relay's publishes were all confirmed).
        if published_at is None and all(not w.is_alive() for w in writers):
            if written_at is None:
                written_at = time.time()
            if _left(dsn) == 0:
                published_at = time.monotonic()
        elif published_at is not None and time.monotonic() - published_at > 2.0:
            break
    window = time.time() - started
    relay_after = sum(proc.cpu_times()[:2])
    meter.sample()
    for w in writers:
        w.join()
    relay.send_signal(signal.SIGTERM)
    relay.wait(30)
    consumer.stop.set()
    consumer.join(10)
    got = consumer.latencies
    left = _left(dsn)
    if left:
        raise RuntimeError(f"{left} of {expected} events still in the outbox")
    if not got:
        raise RuntimeError(f"the consumer received none of the {expected} events")
    ms = sorted(x * 1000 for x in got)
    return {
        "rate": rate, "events": expected,
        # What the writers reached (a paced rate this machine cannot hold comes out lower).
        "written_per_s": (expected / (written_at - begin)
                          if rate is not None and written_at else None),
        "window_s": window, "consumer_received": len(got),
        "relay_cpu_us_per_event": (relay_after - relay_before) * 1e6 / expected,
        "db_cpu_us_per_event": meter.used() * 1e6 / expected,
        "db_cpu_us_per_event_by_role": {role: used * 1e6 / expected
                                        for role, used in meter.by_role().items()},
        "p50_ms": statistics.median(ms) if rate is not None else None,
        "p99_ms": ms[int(len(ms) * 0.99) - 1] if rate is not None else None,
    }  # fmt: skip


def _left(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox").fetchone()
    return int(row[0]) if row else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rates", type=float, nargs="*", default=[50, 500, 5000])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--drain", action="store_true", help="also drain a preloaded backlog")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SRC")
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    args = ap.parse_args()
    migrate(args.dsn)
    variants: dict[str, str | None] = {"cli": None}
    for spec in args.variant:
        name, _, src = spec.partition("=")
        variants[name] = str(Path(src).resolve())
    backlog = int(max(args.rates) * args.seconds)
    cases: list[float | None] = [*args.rates, *([None] if args.drain else [])]
    results: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    with kafka_broker(args.kafka) as bootstrap:
        for round_no in range(1, args.rounds + 1):
            for rate in cases:
                for name, src in variants.items():
                    row = one_run(args.dsn, bootstrap, src, rate, args.seconds, backlog)
                    results.setdefault((name, rate), []).append(row)
                    what = "drain" if rate is None else f"{rate:g}/s"
                    late = "" if rate is None else (
                        f", p50 {row['p50_ms']:.1f} ms p99 {row['p99_ms']:.1f} ms"
                        f" (written {row['written_per_s'] or 0:.0f}/s)")  # fmt: skip
                    relay_us, db_us = row["relay_cpu_us_per_event"], row["db_cpu_us_per_event"]
                    short = "" if row["consumer_received"] == row["events"] else (
                        f" (the consumer got {row['consumer_received']} of {row['events']};"
                        " the relay published all)")  # fmt: skip
                    roles = ", ".join(
                        f"{role} {us:.1f}"
                        for role, us in sorted(row["db_cpu_us_per_event_by_role"].items())
                    )
                    print(f"round {round_no} {name:8s} {what:>7s}: relay {relay_us:6.1f}"
                          f" µs/event, its database {db_us:6.1f} µs/event ({roles}){late}"
                          f"{short}", flush=True)  # fmt: skip
    summary = []
    for (name, rate), rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in
               ("relay_cpu_us_per_event", "db_cpu_us_per_event")}  # fmt: skip
        if rate is not None:
            med |= {k: statistics.median(r[k] for r in rows) for k in ("p50_ms", "p99_ms")}
        summary.append({"variant": name, "rate": rate, **med, "runs": rows})
    save("relay_steady", {"server": server_facts(args.dsn), "seconds": args.seconds,
                          "results": summary})  # fmt: skip


if __name__ == "__main__":
    main()
