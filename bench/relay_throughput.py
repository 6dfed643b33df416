"""Relay throughput against the two ceilings of this machine, side by side in one run.

Pre-loads N events (~300-byte JSON, 1 000 keys) and drains them to Kafka
(Tansu, in memory) with one relay; measures, on the same rows:

* ceiling (a): a bare confluent-kafka producer sending the same messages from memory;
* ceiling (b): a bare SQL loop running only the relay's own claim + settle statements
  (imported from ``outboxkit.backends.postgres.postgres``) with the relay's parameters, no
  publishing; also with ``synchronous_commit`` (every relay commit waits for its WAL flush);
* the CPU each of them spends per event (machine, client process, broker), and the
  bound that follows for a process that must do both jobs on the same cores;
* the relay in one process (events/s from first claim to last settled ack), with
  library defaults (for Kafka: batch 1 000, 4 in flight), the generic 500 x 2, and a sweep;
* the relay engine with a publisher that confirms at once (the database side alone);
* the "delete in a transaction held across the publish" pattern (DB part alone, and
  with Kafka), evaluated, not offered;
* 1 vs 2 ``outboxkit relay`` processes (steady-state rate, 2 %..98 % drained);
* the relay to NATS JetStream.

``--focus`` (issue 24 item 2) measures only the relay's CPU per event against the two floors
(a bare idempotent producer, a bare lease-claim-delete loop), every contender a child process
measured by bench/_measure.py (whole-life CPU, an n and an n0 run differenced); ``--cli``
adds ``outboxkit relay``. The full run keeps its in-process contenders for the rates.

    python bench/relay_throughput.py --dsn postgresql://postgres@127.0.0.1/bench [--quick]
    python bench/relay_throughput.py --dsn ... --focus --cli --events 60000 --repeat 3
    python bench/relay_throughput.py --dsn ... --focus --cli --variant before=/tmp/base/src
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from _common import (
    TOPIC,
    CpuMeter,
    broker_pid,
    ensure_topic,
    fmt_rate,
    kafka_broker,
    prepare,
    reload,
    remaining,
    save,
    server_facts,
)
from _floors import BARE_CLAIM, BARE_DELETE

from outboxkit import OutboundMessage, PublishResult, Relay
from outboxkit.backends.postgres.postgres import Statements
from outboxkit.publishers.kafka import _DEFAULTS as KAFKA_DEFAULTS
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.testing import spawn_relay
from outboxkit.wire.kafka import encode_headers as kafka_headers

SEED_COLUMNS = (
    "event_id, topic, key, event_type, aggregate_type, aggregate_id, payload, headers, now()"
)


def seed_messages(dsn: str, limit: int) -> list[OutboundMessage]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT {SEED_COLUMNS} FROM bench_seed LIMIT %s", (limit,)).fetchall()
    return [
        OutboundMessage(
            event_id=r[0],
            topic=TOPIC,
            key=r[2],
            event_type=r[3],
            aggregate_type=r[4],
            aggregate_id=r[5],
            payload=bytes(r[6]),
            headers=r[7],
            created_at=r[8],
        )
        for r in rows
    ]


# -- CPU of the run's own processes ----------------------------------------------------


class RunCpuMeter(CpuMeter):
    """``CpuMeter`` plus the CPU of the run's own processes: this one, the broker and the
    whole PostgreSQL server (the postmaster, its live children, and the backends that
    exited during the window, which the postmaster's children-times counters hold).

    On a machine shared with other work the machine's busy time counts that work too;
    ``us_per_event_own`` does not, and on a quiet machine the two agree.
    """

    def __init__(self, broker: int | None, dsn: str) -> None:
        super().__init__(broker)
        import psutil

        port = int(psycopg.conninfo.conninfo_to_dict(dsn).get("port") or 5432)
        pid = broker_pid(f"127.0.0.1:{port}")
        self._pg = psutil.Process(pid) if pid else None

    def _pg_cpu(self) -> float:
        if self._pg is None:
            return 0.0
        t = self._pg.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for child in self._pg.children():
            with contextlib.suppress(Exception):  # exited since listed: in children_* now
                total += sum(child.cpu_times()[:2])
        return float(total)

    def start(self) -> None:
        self._pg0 = self._pg_cpu()
        super().start()

    def stop(self, events: int) -> dict[str, float]:
        out = super().stop(events)
        pg = self._pg_cpu() - self._pg0
        per = 1e6 / max(events, 1)
        out["us_per_event_postgres"] = pg * per
        out["us_per_event_own"] = (
            out["us_per_event_client"] + out["us_per_event_broker"] + pg * per
            if self._pg is not None
            else out["us_per_event_total"]
        )
        return out


# -- ceiling (a): the broker -------------------------------------------------------


def kafka_ceiling(
    bootstrap: str, messages: list[OutboundMessage], meter: CpuMeter
) -> dict[str, Any]:
    """The same messages, key and headers as the relay sends, produced from memory."""
    from confluent_kafka import Producer

    prepared = [(m.key.encode() if m.key else None, m.payload, kafka_headers(m)) for m in messages]
    producer = Producer({**KAFKA_DEFAULTS, "bootstrap.servers": bootstrap})
    # Connected and past the idempotent producer's id handshake (which otherwise holds
    # the first delivery for up to 0.5 s), as the relay's publisher is in the relay runs.
    producer.produce(TOPIC, b"warm-up")
    producer.flush(10)
    acked = 0
    errors = 0

    def on_delivery(err: Any, _msg: Any) -> None:
        nonlocal acked, errors
        if err is None:
            acked += 1
        else:
            errors += 1

    meter.start()
    t0 = time.perf_counter()
    for key, value, headers in prepared:
        while True:
            try:
                producer.produce(
                    TOPIC, value=value, key=key, headers=headers, on_delivery=on_delivery
                )
                break
            except BufferError:
                producer.poll(0.001)
        producer.poll(0)
    producer.flush(60)
    elapsed = time.perf_counter() - t0
    return {
        "events": len(prepared),
        "acked": acked,
        "errors": errors,
        "seconds": elapsed,
        "rate": acked / elapsed,
        "cpu": meter.stop(acked),
    }


# -- ceiling (b): the relay's own SQL ---------------------------------------------------


def sql_ceiling(
    dsn: str, n: int, batch: int, meter: CpuMeter, *, commit: str | None = "off"
) -> dict[str, Any]:
    """Claim + fenced delete, sequential on one connection: the database work of a relay.

    The relay's own statements with the relay's own parameters: binary results, and
    ``commit`` as the relay passes it ('off' by default, None with ``synchronous_commit``).
    """
    stmts = Statements("outbox")
    reload(dsn, limit=n)
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        meter.start()
        t0 = time.perf_counter()
        while True:
            token = uuid.uuid4()
            params = {
                "lease": 30.0,
                "token": token,
                "relay_id": "sql-ceiling",
                "limit": batch,
                "max_attempts": 10,
                "commit": commit,
            }
            rows = conn.execute(stmts.claim_batch, params, binary=True).fetchall()
            if not rows:
                break
            conn.execute(stmts.settle_published_delete, ([r[0] for r in rows], token, commit))
            done += len(rows)
        elapsed = time.perf_counter() - t0
    return {
        "events": done,
        "seconds": elapsed,
        "rate": done / elapsed,
        "batch": batch,
        "synchronous_commit": commit is None,
        "cpu": meter.stop(done),
    }


# The database work any lease-based relay must do, written by hand (issue 14): the same
# statements as the child-process floor (bench/_floors.py).


def sql_bare(dsn: str, n: int, batch: int, meter: CpuMeter) -> dict[str, Any]:
    """The floor of a relay's database work: ``BARE_CLAIM`` + ``BARE_DELETE``, commits
    not waiting for the WAL flush, one connection, binary results."""
    reload(dsn, limit=n)
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        meter.start()
        t0 = time.perf_counter()
        while True:
            token = uuid.uuid4()
            rows = conn.execute(BARE_CLAIM, (token, batch), binary=True).fetchall()
            if not rows:
                break
            conn.execute(BARE_DELETE, ([r[0] for r in rows], token))
            done += len(rows)
        elapsed = time.perf_counter() - t0
        cpu = meter.stop(done)  # before the backend exits
    return {"events": done, "seconds": elapsed, "rate": done / elapsed, "batch": batch, "cpu": cpu}


# -- the relay ------------------------------------------------------------------------


class WindowPublisher:
    """Starts the CPU meter at the relay's first produce: the relay's start-up (connections,
    the table check, the first claim) stays out of its CPU per event, as the ceilings'
    set-up stays out of theirs."""

    def __init__(self, inner: Any, meter: CpuMeter | None) -> None:
        self.inner = inner
        self.meter = meter
        self.name = getattr(inner, "name", "kafka")
        self.first_produce: float | None = None

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def publish_batch(self, messages: Any) -> list[PublishResult]:
        if self.first_produce is None:
            self.first_produce = time.perf_counter()
            if self.meter is not None:
                self.meter.start()
        result: list[PublishResult] = await self.inner.publish_batch(messages)
        return result

    def __getattr__(self, name: str) -> Any:  # batch_shape, reachability, ...
        return getattr(self.inner, name)


async def _relay_run(
    dsn: str,
    publisher: Any,
    n: int,
    meter: CpuMeter | None = None,
    warm_up: OutboundMessage | None = None,
    **options: Any,
) -> dict[str, Any]:
    await publisher.start()  # connected before the clock starts, as in a running relay
    if warm_up is not None:
        await publisher.publish_batch([warm_up])
    window = WindowPublisher(publisher, meter)
    relay = Relay(dsn, window, listen=False, poll_interval=0.05, **options)
    t0 = time.perf_counter()
    task = asyncio.create_task(relay.run())
    while relay.stats.published < n and not task.done():  # noqa: ASYNC110 (polling is the probe)
        await asyncio.sleep(0.002)
    elapsed = time.perf_counter() - t0
    # CPU from the first produce to the last settle (the meter started at the first produce).
    cpu = meter.stop(relay.stats.published) if meter is not None else None
    relay.stop()
    await task
    return {
        "events": relay.stats.published,
        "seconds": elapsed,
        "rate": relay.stats.published / elapsed,
        "batches": relay.stats.batches,
        "options": options,
        "cpu": cpu,
    }


def relay_kafka(
    dsn: str, bootstrap: str, n: int, meter: CpuMeter | None = None, **options: Any
) -> dict[str, Any]:
    warm_up = seed_messages(dsn, 1)[0]
    n = reload(dsn, limit=n)
    publisher = KafkaPublisher({"bootstrap.servers": bootstrap})
    return asyncio.run(_relay_run(dsn, publisher, n, meter, warm_up, **options))


class ConfirmAtOnce:
    """A publisher whose broker confirms everything at once: the engine's database side alone."""

    name = "confirm-at-once"

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def publish_batch(self, messages: Any) -> list[PublishResult]:
        await asyncio.sleep(0)
        return [PublishResult.success()] * len(messages)


def relay_null(dsn: str, n: int, meter: CpuMeter, **options: Any) -> dict[str, Any]:
    n = reload(dsn, limit=n)
    return asyncio.run(_relay_run(dsn, ConfirmAtOnce(), n, meter, **options))


def relay_nats(dsn: str, n: int) -> dict[str, Any]:
    from outboxkit.publishers.nats import NatsPublisher
    from outboxkit.testing import EmbeddedNats

    with EmbeddedNats() as server:
        n = reload(dsn, limit=n)
        publisher = NatsPublisher.from_url(
            f"{server.url}?stream=BENCH&subjects={TOPIC.split('.')[0]}.>"
        )
        return asyncio.run(_relay_run(dsn, publisher, n, None, seed_messages(dsn, 1)[0]))


# -- the "delete in a transaction held across the publish" pattern -----------------------

# Evaluated here, not offered by the library: see docs/benchmarks.md for its failure modes.
DELETE_HELD = """
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox WHERE status = 0 AND available_at <= now()
    ORDER BY available_at, id LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING id, event_id, key, payload, headers
"""


def delete_held(dsn: str, n: int, batch: int, bootstrap: str | None) -> dict[str, Any]:
    """BEGIN; DELETE … RETURNING; publish and wait for acks; COMMIT — sequential."""
    producer = None
    if bootstrap is not None:
        from confluent_kafka import Producer

        producer = Producer({**KAFKA_DEFAULTS, "bootstrap.servers": bootstrap})
    reload(dsn, limit=n)
    done = 0
    with psycopg.connect(dsn) as conn:
        t0 = time.perf_counter()
        while True:
            with conn.transaction():
                rows = conn.execute(DELETE_HELD, (batch,)).fetchall()
                if producer is not None:
                    for r in rows:
                        headers = [("idempotency-key", str(r[1]).encode())]
                        headers += [(k, v.encode()) for k, v in r[4].items()]
                        producer.produce(TOPIC, value=r[3], key=r[2].encode(), headers=headers)
                    if producer.flush(30) != 0:
                        raise RuntimeError("kafka did not confirm the batch")
            if not rows:
                break
            done += len(rows)
        elapsed = time.perf_counter() - t0
    return {"events": done, "seconds": elapsed, "rate": done / elapsed, "batch": batch}


# -- relay processes ------------------------------------------------------------------


def relay_processes(dsn: str, broker_url: str, n: int, procs: int) -> dict[str, Any]:
    """``outboxkit relay`` times procs; the steady rate while 2 %..98 % of the rows drain."""
    reload(dsn, limit=n)
    logdir = Path(tempfile.mkdtemp(prefix="outboxkit-bench-"))
    children = [
        spawn_relay(
            dsn,
            broker_url,
            logdir / f"relay{i}.log",
            "--no-listen",
            "--poll-interval",
            "0.05",
            log_level="warning",
        )
        for i in range(procs)
    ]
    samples: list[tuple[float, int]] = []
    deadline = time.monotonic() + 600
    # Counting a large backlog costs the server work of its own: sample it less often.
    interval = 0.25 if n >= 100_000 else 0.02
    try:
        while time.monotonic() < deadline:
            left = remaining(dsn)
            samples.append((time.perf_counter(), left))
            if left == 0:
                break
            time.sleep(interval)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(30)
    hi, lo = n * 0.98, n * 0.02
    start = next(s for s in samples if s[1] <= hi)
    end = next(s for s in samples if s[1] <= lo)
    if end[0] <= start[0]:  # drained between two samples: widen to the last full sample
        start = max((s for s in samples if s[1] == n), default=samples[0])
    rate = (start[1] - end[1]) / max(end[0] - start[0], 1e-6)
    return {"processes": procs, "events": n, "rate": rate, "window_s": end[0] - start[0]}


# -- item 2: CPU per event against the floors (bench/_measure.py) ----------------------


def focus(args: argparse.Namespace, n: int, repeat: int, results: dict[str, Any]) -> None:
    """The relay processes against the bare producer and the bare SQL loop, every one a
    child process measured by bench/_measure.py (whole-life CPU, n and n0 runs differenced),
    interleaved round by round; ``--inbench`` adds the old in-process window for comparison.
    """
    from _measure import OwnCpu, measure

    n0 = args.small or n // 10
    kinds = ["producer", "sql", "inproc"] + (["cli"] if args.cli else [])
    # Other trees' `outboxkit relay` against the same floors in the same rounds (A/B).
    variants = {f"cli_{name}": src for name, _, src in (v.partition("=") for v in args.variant)}
    kinds += list(variants)
    if args.window_floor:
        kinds.append("producer_window")
    if args.paced_floor is not None:
        os.environ["OUTBOXKIT_BENCH_PACE_US"] = str(args.paced_floor)  # (the child's)
        kinds.append("producer_paced")
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    with kafka_broker(args.kafka) as bootstrap:
        ensure_topic(bootstrap, TOPIC)
        own = OwnCpu(bootstrap, args.dsn)
        meter = RunCpuMeter(broker_pid(bootstrap), args.dsn)
        for i in range(repeat):
            for kind in kinds if i % 2 == 0 else kinds[::-1]:
                r = measure(kind, args.dsn, bootstrap, n, n0, own, variants.get(kind))
                runs[kind].append(r)
                us = r["us"]
                print(
                    f"round {i + 1} {kind:9s} process {us['cpu']:6.1f}  broker {us['broker']:5.1f}"
                    f"  postgres {us['postgres']:5.1f}  own {us['own']:6.1f} µs/event"
                    + (f"  rate {r['rate']:,.0f}/s" if r["rate"] else ""),
                    flush=True,
                )
            if args.inbench:  # the method of relay_throughput.py before 2026-12-01
                r = relay_kafka(args.dsn, bootstrap, n, meter)
                runs.setdefault("inbench", []).append(r)
                print(f"round {i + 1} inbench   process {r['cpu']['us_per_event_client']:6.1f}")
    results["runs"] = runs
    results["small"] = n0
    floors = list(zip(runs["producer"], runs["sql"], strict=True))
    out: dict[str, Any] = {"target": 1.3, "goal": 1.15}
    relays = [k for k in kinds[2:] if not k.startswith("producer")]
    if args.window_floor:
        # What the relay's window costs the producer and the broker: the same floor sending
        # in the relay's batch shape, against it queueing everything at once.
        out["window_floor"] = {
            what: {
                "us_per_event_producer_window": statistics.median(
                    r["us"][what] for r in runs["producer_window"]
                ),
                "over_producer_per_round": [
                    round(w["us"][what] / p["us"][what], 3)
                    for w, (p, _) in zip(runs["producer_window"], floors, strict=True)
                ],
            }
            for what in ("cpu", "broker", "own")
        }
    if args.paced_floor is not None:
        out["paced_floor"] = {
            "pace_us": args.paced_floor,
            **{
                what: statistics.median(r["us"][what] for r in runs["producer_paced"])
                for what in ("cpu", "broker", "own")
            },
        }
    for contender in relays:
        for what in ("cpu", "own"):
            # The relay process against the two floors' processes; own: + broker + PostgreSQL.
            ratios = [
                r["us"][what] / (p["us"][what] + q["us"][what])
                for r, (p, q) in zip(runs[contender], floors, strict=True)
            ]
            out[f"{contender}_{what}"] = {
                "us_per_event_relay": statistics.median(r["us"][what] for r in runs[contender]),
                "us_per_event_producer": statistics.median(p["us"][what] for p, _ in floors),
                "us_per_event_sql_bare": statistics.median(q["us"][what] for _, q in floors),
                "ratio_per_round": [round(x, 3) for x in ratios],
                "ratio": round(statistics.median(ratios), 3),
            }
            if args.window_floor:  # the same against the floors with the window's producer
                windowed = [
                    r["us"][what] / (w["us"][what] + q["us"][what])
                    for r, w, (_, q) in zip(
                        runs[contender], runs["producer_window"], floors, strict=True
                    )
                ]
                out[f"{contender}_{what}"]["ratio_window_floor_per_round"] = [
                    round(x, 3) for x in windowed
                ]
                out[f"{contender}_{what}"]["ratio_window_floor"] = round(
                    statistics.median(windowed), 3
                )
    if args.cli:
        pairs = [
            c["us"]["cpu"] / r["us"]["cpu"]
            for c, r in zip(runs["cli"], runs["inproc"], strict=True)
        ]
        out["cli_over_inproc_process_per_round"] = [round(x, 3) for x in pairs]
    results["cpu_vs_unavoidable"] = out
    for key, v in out.items():
        print(f"  {key}: {v}")
    save(
        args.out or ("relay_throughput_focus_cli" if args.cli else "relay_throughput_focus"),
        results,
    )


# -- main -----------------------------------------------------------------------------


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = max(runs, key=lambda r: r["rate"])
    return {
        **out,
        "runs": [round(r["rate"]) for r in runs],
        "median_rate": statistics.median(r["rate"] for r in runs),
    }


def cpu_per_event(runs: list[dict[str, Any]], key: str = "us_per_event_total") -> float:
    """Median CPU (µs) per event over a contender's runs (default: the machine's)."""
    return statistics.median(r["cpu"][key] for r in runs)


# The shape a relay uses for brokers without a batch_shape of their own (webhooks, SQS, AMQP).
GENERIC = {"batch_size": 500, "max_in_flight": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the main contenders")
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    ap.add_argument("--quick", action="store_true", help="20 000 events, one round")
    ap.add_argument("--skip-nats", action="store_true")
    ap.add_argument(
        "--cli",
        action="store_true",
        help="with --focus: also `outboxkit relay` (the CLI process) as contender cli",
    )
    ap.add_argument("--small", type=int, help="with --focus: the n0 run's events (events / 10)")
    ap.add_argument(
        "--window-floor",
        action="store_true",
        help="with --focus: also the producer floor sending in the relay's batch window"
        " (1 000 a batch, 4 unconfirmed) as contender producer_window",
    )
    ap.add_argument(
        "--inbench",
        action="store_true",
        help="with --focus: also the relay in this process, metered first produce to last"
        " settle with no watcher (this script's method before 2026-12-01), for comparison",
    )
    ap.add_argument(
        "--paced-floor",
        type=float,
        metavar="US",
        help="with --focus: also the windowed producer floor spending US µs of CPU per message"
        " (a relay's pace) as contender producer_paced",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="with --focus: also `outboxkit relay` from SRC (e.g. an older commit's src, from"
        " `git archive`) as contender cli_NAME, against the same floors (repeatable)",
    )
    ap.add_argument("--out", help="results name (bench/results/NAME.json)")
    ap.add_argument(
        "--focus",
        action="store_true",
        help="only the relay against the bare producer and the bare SQL loop (CPU per event)",
    )
    args = ap.parse_args()
    n = 20_000 if args.quick else args.events
    repeat = 1 if args.quick else args.repeat
    cores = os.cpu_count() or 1

    t_prep = time.perf_counter()
    payload_bytes = prepare(args.dsn, n)
    print(
        f"prepared {n} events (avg payload {payload_bytes:.0f} B) in"
        f" {time.perf_counter() - t_prep:.1f}s"
    )
    results: dict[str, Any] = {
        "events": n,
        "payload_bytes": payload_bytes,
        "machine": server_facts(args.dsn),
    }
    if args.focus:
        focus(args, n, repeat, results)
        return
    with kafka_broker(args.kafka) as bootstrap:
        ensure_topic(bootstrap, TOPIC)
        meter = RunCpuMeter(broker_pid(bootstrap), args.dsn)
        # Interleave contenders round by round so machine noise hits all of them alike.
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(repeat):
            messages = seed_messages(args.dsn, n)
            runs.setdefault("kafka_ceiling", []).append(kafka_ceiling(bootstrap, messages, meter))
            del messages  # 200 000 objects would slow the in-process relay's garbage collector
            gc.collect()
            runs.setdefault("sql_bare", []).append(sql_bare(args.dsn, n, 1000, meter))
            runs.setdefault("relay", []).append(relay_kafka(args.dsn, bootstrap, n, meter))
            runs.setdefault("sql_ceiling", []).append(sql_ceiling(args.dsn, n, 500, meter))
            runs.setdefault("sql_ceiling_sync", []).append(
                sql_ceiling(args.dsn, n, 500, meter, commit=None)
            )
            runs.setdefault("relay_generic", []).append(
                relay_kafka(args.dsn, bootstrap, n, meter, **GENERIC)
            )
        for name, rs in runs.items():
            results[name] = best(rs)
        # The relay's CPU per event against the floors: --focus (bench/_measure.py's method).
        lower = min(results["kafka_ceiling"]["rate"], results["sql_ceiling"]["rate"])
        results["relay_vs_lower_ceiling"] = results["relay"]["rate"] / lower
        results["relay_generic_vs_lower_ceiling"] = results["relay_generic"]["rate"] / lower
        # A relay does both ceilings' work on the same cores: CPU per event adds up.
        both = cpu_per_event(runs["kafka_ceiling"]) + cpu_per_event(runs["sql_ceiling"])
        results["cpu_bound"] = {
            "cores": cores,
            "us_per_event_kafka_ceiling": cpu_per_event(runs["kafka_ceiling"]),
            "us_per_event_sql_ceiling": cpu_per_event(runs["sql_ceiling"]),
            "us_per_event_relay": cpu_per_event(runs["relay"]),
            "us_per_event_relay_generic": cpu_per_event(runs["relay_generic"]),
            "rate": cores * 1e6 / both,
        }
        results["relay_vs_cpu_bound"] = results["relay"]["rate"] / results["cpu_bound"]["rate"]

        # Tuning: batch size and in-flight window; the relay's commits made synchronous.
        sweep = []
        for batch, window in ((500, 1), (500, 4), (1000, 2), (2000, 4), (1000, 8), (2000, 8)):
            r = relay_kafka(args.dsn, bootstrap, n, batch_size=batch, max_in_flight=window)
            sweep.append({"batch_size": batch, "max_in_flight": window, "rate": r["rate"]})
        results["relay_sweep"] = sweep
        results["relay_synchronous_commit"] = relay_kafka(
            args.dsn, bootstrap, n, meter, synchronous_commit=True
        )
        results["engine_confirm_at_once"] = relay_null(args.dsn, n, meter)

        results["delete_held_sql"] = delete_held(args.dsn, n, 500, None)
        results["delete_held_kafka"] = delete_held(args.dsn, n, 500, bootstrap)

        url = f"kafka://{bootstrap}"
        results["processes_1"] = relay_processes(args.dsn, url, n, 1)
        results["processes_2"] = relay_processes(args.dsn, url, n, 2)
    if not args.skip_nats:
        results["nats"] = relay_nats(args.dsn, n)

    print(f"\nrelay throughput, {n} events, {payload_bytes:.0f}-byte payloads")
    rows = [
        ("ceiling (a) bare confluent-kafka producer", results["kafka_ceiling"]),
        ("ceiling (b) bare SQL claim + settle loop", results["sql_ceiling"]),
        ("  same, synchronous commits", results["sql_ceiling_sync"]),
        ("outboxkit relay -> Kafka, defaults (1000 x 4)", results["relay"]),
        ("outboxkit relay -> Kafka, batch 500 x 2", results["relay_generic"]),
        ("outboxkit relay, synchronous commits", results["relay_synchronous_commit"]),
        ("engine, publisher confirms at once (DB side)", results["engine_confirm_at_once"]),
        ("delete-in-held-tx, DB only", results["delete_held_sql"]),
        ("delete-in-held-tx -> Kafka, sequential", results["delete_held_kafka"]),
        ("outboxkit relay CLI x1 (steady)", results["processes_1"]),
        ("outboxkit relay CLI x2 (steady)", results["processes_2"]),
    ]
    if "nats" in results:
        rows.append(("outboxkit relay -> NATS JetStream", results["nats"]))
    for label, r in rows:
        cpu = r.get("cpu")
        extra = (
            f"  {cpu['us_per_event_total']:5.1f} us CPU/event ({cpu['cores_busy']:.2f} cores)"
            if cpu
            else ""
        )
        print(f"  {label:<48} {fmt_rate(r['rate']):>12}{extra}")
    for s in sweep:
        print(
            f"  sweep batch={s['batch_size']:<5} in_flight={s['max_in_flight']}"
            f"{'':<20} {fmt_rate(s['rate']):>12}"
        )
    bound = results["cpu_bound"]
    print(
        f"  CPU bound for doing (a) and (b) on {cores} cores: {fmt_rate(bound['rate'])}"
        f" -> relay at {results['relay_vs_cpu_bound']:.0%} of it"
    )
    print(
        f"  relay / lower ceiling = {results['relay_vs_lower_ceiling']:.0%}"
        f" (500 x 2: {results['relay_generic_vs_lower_ceiling']:.0%}; target >= 90 %)"
    )
    save("relay_throughput", results)


if __name__ == "__main__":
    main()
