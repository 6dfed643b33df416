"""The WAL relay (`--source cdc`) next to the polling relay, same events, same run, to Kafka.

* throughput: N events pre-written, drained by the polling relay (claim/settle/delete), by the
  CDC relay from table inserts, and by the CDC relay from WAL-only messages
  (``pg_logical_emit_message``, as ``Outbox(storage="wal")`` writes them);
* commit -> broker-ack latency p50/p99 at a steady 1 000 events/s (10 events per transaction
  every 10 ms) for the same three: measured when the relay gets the broker's answer, from
  the event's ``created_at`` (the commit time for the CDC relay; the insert time, a few
  hundred microseconds before the commit, for the polling relay).

    python bench/cdc_throughput.py [--quick] [--dsn postgresql://... (wal_level=logical)]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from _common import ensure_topic, kafka_broker, make_event, prepare, reload, save, server_facts

from outboxkit import OutboundMessage, Outbox, PublishResult, Relay
from outboxkit.cdc import slots
from outboxkit.cdc.relay import CdcRelay
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.sink.observer import RelayObserver
from outboxkit.write.wal_envelope import encode_envelope, message_prefix


class _Latency(RelayObserver):
    """Commit -> broker answer, per confirmed event."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.recording = False

    def processed(
        self, messages: Sequence[OutboundMessage], results: Sequence[PublishResult], seconds: float
    ) -> None:
        if not self.recording:
            return
        now = time.time()
        for m, r in zip(messages, results, strict=True):
            if r.ok:
                self.samples.append(now - m.created_at.timestamp())


@contextlib.contextmanager
def _server(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    from outboxkit.testing import EmbeddedPostgres

    pg = EmbeddedPostgres(logical=True)
    pg.start()
    try:
        yield pg.dsn
    finally:
        pg.close()


def _write_wal(dsn: str, n: int, topic: str, per_tx: int = 1000) -> None:
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        for start in range(0, n, per_tx):
            cur.executemany(
                "SELECT pg_logical_emit_message(true, %s, %s)",
                [
                    (message_prefix("outbox"), encode_envelope(make_event(i, topic=topic)))
                    for i in range(start, min(n, start + per_tx))
                ],
            )
            conn.commit()


async def _drain(relay: Any, done: Any) -> float:
    task = asyncio.create_task(relay.run())
    started = time.perf_counter()
    try:
        while not done():
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        return time.perf_counter() - started
    finally:
        relay.stop()
        await task


def _steady_writer(dsn: str, topic: str, seconds: float, wal: bool, stop: threading.Event) -> int:
    """10 events per transaction every 10 ms: 1 000 events/s."""
    outbox = Outbox()
    written = 0
    with psycopg.connect(dsn) as conn:
        next_at = time.perf_counter()
        deadline = next_at + seconds
        while time.perf_counter() < deadline and not stop.is_set():
            events = [make_event(written + i, topic=topic) for i in range(10)]
            if wal:
                with conn.cursor() as cur:
                    cur.executemany(
                        "SELECT pg_logical_emit_message(true, %s, %s)",
                        [(message_prefix("outbox"), encode_envelope(e)) for e in events],
                    )
            else:
                outbox.put_many(conn, events)
            conn.commit()
            written += 10
            next_at += 0.01
            time.sleep(max(0.0, next_at - time.perf_counter()))
    return written


async def _latency(
    make_relay: Any, dsn: str, topic: str, seconds: float, wal: bool
) -> dict[str, Any]:
    observer = _Latency()
    relay = make_relay(observer)
    task = asyncio.create_task(relay.run())
    try:
        await asyncio.sleep(2.0)  # connected and idle
        observer.recording = True
        stop = threading.Event()
        written = await asyncio.to_thread(_steady_writer, dsn, topic, seconds, wal, stop)
        deadline = time.monotonic() + 30
        # polled: the samples come from the relay's hook, not an awaitable
        while len(observer.samples) < written and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    finally:
        relay.stop()
        await task
    s = sorted(observer.samples)
    return {
        "events": len(s),
        "p50_ms": round(1000 * statistics.median(s), 2),
        "p99_ms": round(1000 * s[int(len(s) * 0.99) - 1], 2),
        "max_ms": round(1000 * s[-1], 2),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", help="a database on a server with wal_level=logical")
    parser.add_argument("--kafka", help="kafka://host:port [default: embedded Tansu]")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--events", type=int, default=None)
    args = parser.parse_args()
    n = args.events or (10_000 if args.quick else 50_000)
    seconds = 5.0 if args.quick else 20.0
    results: dict[str, Any] = {"events": n}
    with _server(args.dsn) as dsn, kafka_broker(args.kafka) as bootstrap:
        results["server"] = server_facts(dsn)
        url = f"kafka://{bootstrap}"
        run = uuid.uuid4().hex[:6]
        topics = {k: f"bench.{k}.{run}" for k in ("poll", "cdc_table", "cdc_wal", "lat")}
        for t in topics.values():
            ensure_topic(bootstrap, t)
        prepare(dsn, n)
        # The polling relay first: once the slot exists its writes would reach the stream.
        reload(dsn, topic=topics["poll"])
        poll = Relay(dsn, KafkaPublisher.from_url(url))
        elapsed = await _drain(poll, lambda: poll.stats.published >= n)
        results["poll"] = {"seconds": round(elapsed, 2), "rate": round(n / elapsed)}
        print(f"polling relay      {n / elapsed:>9,.0f} events/s")
        slots.setup(dsn)
        reload(dsn, topic=topics["cdc_table"])
        cdc = CdcRelay(dsn, KafkaPublisher.from_url(url))
        elapsed = await _drain(cdc, lambda: cdc.stats.published >= n)
        results["cdc_table"] = {"seconds": round(elapsed, 2), "rate": round(n / elapsed)}
        print(f"cdc, table inserts {n / elapsed:>9,.0f} events/s")
        await asyncio.to_thread(_write_wal, dsn, n, topics["cdc_wal"])
        cdc = CdcRelay(dsn, KafkaPublisher.from_url(url))
        elapsed = await _drain(cdc, lambda: cdc.stats.published >= n)
        results["cdc_wal"] = {"seconds": round(elapsed, 2), "rate": round(n / elapsed)}
        print(f"cdc, WAL messages  {n / elapsed:>9,.0f} events/s")
        for name in ("cdc_table", "cdc_wal"):
            results[name]["vs_poll"] = round(results[name]["rate"] / results["poll"]["rate"], 2)
        # Latency at 1 000 events/s. The slot is dropped for the polling relay's run.
        latency: dict[str, Any] = {}
        latency["cdc_table"] = await _latency(
            lambda o: CdcRelay(dsn, KafkaPublisher.from_url(url), observer=o),
            dsn,
            topics["lat"],
            seconds,
            False,
        )
        latency["cdc_wal"] = await _latency(
            lambda o: CdcRelay(dsn, KafkaPublisher.from_url(url), observer=o),
            dsn,
            topics["lat"],
            seconds,
            True,
        )
        slots.drop(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE outbox")
        latency["poll"] = await _latency(
            lambda o: Relay(dsn, KafkaPublisher.from_url(url), observer=o),
            dsn,
            topics["lat"],
            seconds,
            False,
        )
        results["latency_at_1000_per_s"] = latency
        for name, figures in latency.items():
            print(f"latency {name:<10} p50 {figures['p50_ms']} ms  p99 {figures['p99_ms']} ms")
    save("cdc_throughput", results)


if __name__ == "__main__":
    asyncio.run(main())
