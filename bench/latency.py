"""Commit-to-broker-ack latency at a steady write rate, with NOTIFY wake-ups on and off.

A writer process commits one event per transaction at a steady rate; each event
carries the wall-clock time taken just before its COMMIT (so the figure includes
the commit's own fsync, a slight overstatement). The relay runs in this process
behind a thin publisher wrapper that, when the broker has confirmed a batch,
records ``ack time - stamp`` for each event. Kafka is Tansu, in memory.

    python bench/latency.py --dsn postgresql://postgres@127.0.0.1/bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
from _common import ensure_topic, kafka_broker, make_event, save, server_facts

from outboxkit import OutboundMessage, Outbox, PublishResult, Relay, migrate
from outboxkit.publishers.kafka import KafkaPublisher

TOPIC = "bench.latency"
STAMP = "x-bench-commit-stamp"


def writer(dsn: str, rate: float, seconds: float, notify: bool) -> None:
    """One event per transaction, on a fixed schedule (no catch-up bursts)."""
    outbox = Outbox(notify=notify)
    total = int(rate * seconds)
    with psycopg.connect(dsn) as conn:
        t0 = time.perf_counter()
        for i in range(total):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with conn.transaction():
                event = make_event(i, topic=TOPIC, headers={STAMP: repr(time.time())})
                outbox.put(conn, event)


class TimingPublisher:
    """Wraps the real publisher; records commit→ack per confirmed event."""

    name = "timing"

    def __init__(self, inner: KafkaPublisher) -> None:
        self.inner = inner
        self.latencies: list[float] = []
        #: Ack time per event id (joined with commit times a writer logged, if it did).
        self.acks: dict[str, float] = {}

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        results = await self.inner.publish_batch(messages)
        now = time.time()
        for m, r in zip(messages, results, strict=True):
            stamp = m.headers.get(STAMP)
            if r.ok and stamp is not None:
                self.latencies.append(now - float(stamp))
                self.acks[str(m.event_id)] = now
        return results


def commit_times(logs: Path) -> dict[str, str]:
    """Event id -> commit time, from the ``event_id time`` lines of every file in ``logs``."""
    return dict(
        line.split() for f in sorted(logs.iterdir()) for line in f.read_text().split("\n") if line
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(
    dsn: str,
    bootstrap: str,
    rate: float,
    seconds: float,
    write: Callable[..., None],
    write_args: tuple[Any, ...],
    commit_log: Path | None = None,
    **relay_options: Any,
) -> dict[str, Any]:
    """A relay on ``dsn`` to Kafka while ``write(*write_args)`` runs in its own process at
    ``rate`` for ``seconds``: commit -> ack percentiles (shared with bench/mariadb.py).

    ``commit_log``: a directory where the writer left ``event_id commit_time`` lines, the
    time taken right after COMMIT returned; latencies are then ack minus that time, and the
    rate achieved is the events over the span of their commits.
    """
    publisher = TimingPublisher(KafkaPublisher({"bootstrap.servers": bootstrap}))
    await publisher.start()
    relay = Relay(dsn, publisher, **relay_options)
    task = asyncio.create_task(relay.run())
    await asyncio.sleep(1.0)  # connected and listening
    proc = multiprocessing.get_context("spawn").Process(target=write, args=write_args)
    proc.start()
    started = time.monotonic()
    expected = int(rate * seconds)
    deadline = time.monotonic() + seconds + 60
    while len(publisher.latencies) < expected and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    await asyncio.to_thread(proc.join)
    writing = time.monotonic() - started  # longer than `seconds` when the writer lags
    relay.stop()
    await task
    lat = [x * 1000 for x in publisher.latencies]
    achieved = len(lat) / writing
    extra: dict[str, Any] = {"stamp": "before COMMIT"}
    if commit_log is not None:
        commits = commit_times(commit_log)
        times = [float(t) for t in commits.values()]
        lat = [
            (publisher.acks[e] - float(t)) * 1000 for e, t in commits.items() if e in publisher.acks
        ]
        achieved = len(times) / (max(times) - min(times))
        extra = {
            "stamp": "after COMMIT returned",
            "committed": len(times),
            "not_acked": len(times) - len(lat),
        }
    return {
        "rate": rate,
        "achieved_rate": achieved,
        **extra,
        "seconds": seconds,
        "events": len(lat),
        "p50_ms": statistics.median(lat),
        "p90_ms": pct(lat, 0.90),
        "p99_ms": pct(lat, 0.99),
        "max_ms": max(lat),
        "mean_ms": statistics.fmean(lat),
    }


async def run(
    dsn: str, bootstrap: str, rate: float, seconds: float, notify: bool, poll_interval: float
) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
    done = await measure(
        dsn,
        bootstrap,
        rate,
        seconds,
        writer,
        (dsn, rate, seconds, notify),
        listen=notify,
        poll_interval=poll_interval,
    )
    return {"notify": notify, "poll_interval_s": poll_interval, **done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    ap.add_argument("--quick", action="store_true", help="10 s per variant")
    args = ap.parse_args()
    seconds = 10.0 if args.quick else args.seconds

    migrate(args.dsn)
    results: dict[str, Any] = {"machine": server_facts(args.dsn)}
    variants = [
        ("notify_on", True, 1.0),  # the default: LISTEN/NOTIFY wake-ups, 1 s safety poll
        ("notify_off_poll_10ms", False, 0.01),  # fast idle polling on the partial index
        ("notify_off_poll_1s", False, 1.0),  # defaults minus NOTIFY: latency = poll interval
    ]
    with kafka_broker(args.kafka) as bootstrap:
        ensure_topic(bootstrap, TOPIC)
        for name, notify, poll in variants:
            # Without NOTIFY and with a 1 s poll the answer is known (~poll/2): 20 s suffice.
            secs = min(seconds, 20.0) if poll >= 1.0 and not notify else seconds
            results[name] = asyncio.run(run(args.dsn, bootstrap, args.rate, secs, notify, poll))
    print(f"\ncommit -> Kafka ack latency at {args.rate:.0f} events/s for {seconds:.0f} s")
    print(f"  {'variant':<24} {'events':>7} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}  (ms)")
    for name, *_ in variants:
        r = results[name]
        print(
            f"  {name:<24} {r['events']:>7} {r['p50_ms']:>8.1f} {r['p90_ms']:>8.1f}"
            f" {r['p99_ms']:>8.1f} {r['max_ms']:>8.1f}"
        )
    print("  target (NOTIFY on): p50 <= 5 ms, p99 <= 25 ms")
    save("latency", results)


if __name__ == "__main__":
    main()
