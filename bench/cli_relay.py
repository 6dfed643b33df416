"""``outboxkit relay`` (the CLI process, defaults) next to the in-process ``Relay``, one run.

Both contenders run as child processes on the same preloaded rows (100 000 events by
default, ~230-byte JSON, 1 000 keys), round after round, interleaved (A B A B ...), so
machine load hits both alike. Each is timed from the broker's side: a consumer in this
process reads the topic and the window is first message to last (process start-up,
connecting and the first claim's wait are outside it). CPU per event is the relay
process's own CPU time (user + system, librdkafka's threads included) over that window,
read from /proc through psutil when the first and the last message arrive.

* ``cli``: ``python -m outboxkit relay`` with its defaults (log level info, summary log,
  batch tracing when opentelemetry is installed, no metrics port);
* ``inproc``: a child process running ``Relay(dsn, from_url(broker))`` with the same
  defaults and no observer, as bench/relay_throughput.py runs it.

    python bench/cli_relay.py --dsn postgresql://postgres@127.0.0.1/bench [--events N]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import TOPIC, ensure_topic, kafka_broker, prepare, reload, save, server_facts

from outboxkit.testing import spawn_relay

INPROC = """
import asyncio, signal, sys
from outboxkit import Relay
from outboxkit.publishers import from_url

async def main():
    relay = Relay(sys.argv[1], from_url(sys.argv[2]))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, relay.stop)
    await relay.run()

asyncio.run(main())
"""


class Watch:
    """Consume ``TOPIC`` from its end; note when the first and the n-th new message arrive,
    and the relay process's CPU time at both moments."""

    def __init__(self, bootstrap: str, n: int, pid: int | None = None) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self.n, self.count = n, 0
        self.first = self.last = 0.0
        self.cpu_first = self.cpu_last = 0.0
        self.pid = pid
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-{os.getpid()}-{time.monotonic_ns()}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 10,
            }
        )
        _low, high = self._consumer.get_watermark_offsets(TopicPartition(TOPIC, 0), timeout=10)
        self._consumer.assign([TopicPartition(TOPIC, 0, high)])
        # Tansu reports a high watermark behind the tail (4 341 of 20 000 just-flushed
        # messages, measured): read past it until the topic is quiet, before any relay
        # starts, or the window opens on stale messages and takes in the relay's start-up.
        self.stale = 0
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 1.0:
            msgs = self._consumer.consume(10_000, 0.2)
            if msgs:
                self.stale += len(msgs)
                quiet_since = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _cpu(self) -> float:
        import psutil

        if self.pid is None:
            return 0.0
        t = psutil.Process(self.pid).cpu_times()
        return float(t.user + t.system)

    def start(self, pid: int) -> None:
        self.pid = pid
        self._thread.start()

    def _run(self) -> None:
        while self.count < self.n:
            msgs = self._consumer.consume(10_000, 0.05)
            if not msgs:
                continue
            now = time.perf_counter()
            got = sum(1 for m in msgs if m.error() is None)
            if self.count == 0 and got:
                self.first, self.cpu_first = now, self._cpu()
            self.count += got
        self.last, self.cpu_last = time.perf_counter(), self._cpu()
        self._done.set()

    def wait(self, timeout: float) -> bool:
        ok = self._done.wait(timeout)
        self._consumer.close()
        return ok


def run_one(
    kind: str,
    dsn: str,
    broker_url: str,
    bootstrap: str,
    n: int,
    logdir: Path,
    variants: dict[str, str],
) -> dict[str, Any]:
    n = reload(dsn, limit=n)
    watch = Watch(bootstrap, n)
    if kind == "cli":
        child = spawn_relay(dsn, broker_url, logdir / "cli.log", log_level=None)
    elif kind.startswith("cli_"):  # cli_baseline, or a --variant's
        env = {"PYTHONPATH": str(variants[kind])}
        child = spawn_relay(dsn, broker_url, logdir / f"{kind}.log", log_level=None, env=env)
    else:
        log = (logdir / "inproc.log").open("ab")
        child = subprocess.Popen(
            [sys.executable, "-c", INPROC, dsn, broker_url], stdout=log, stderr=log
        )
    watch.start(child.pid)
    try:
        if not watch.wait(300):
            raise RuntimeError(f"{kind}: {watch.count} of {n} events in 300 s")
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(60)
    seconds = watch.last - watch.first
    # The first message's arrival starts the clock: n - 1 intervals.
    return {
        "kind": kind,
        "events": n,
        "seconds": seconds,
        "rate": (n - 1) / seconds,
        "cpu_us_per_event": (watch.cpu_last - watch.cpu_first) * 1e6 / (n - 1),
        "stale_skipped": watch.stale,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kafka", help="bootstrap host:port of a Kafka to use (default: Tansu)")
    ap.add_argument("--out", default="cli_relay")
    ap.add_argument(
        "--baseline-src",
        help="A/B: also run `outboxkit relay` from this src directory (e.g. an older"
        " commit's, from `git worktree add`) as contender cli_baseline",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="A/B/C: also run `outboxkit relay` from SRC as contender cli_NAME (repeatable;"
        " one change per src copy measures each change in the same run)",
    )
    args = ap.parse_args()
    variants = {"cli_baseline": args.baseline_src} if args.baseline_src else {}
    for spec in args.variant:
        name, _, src = spec.partition("=")
        variants[f"cli_{name}"] = src

    size = prepare(args.dsn, args.events)
    logdir = Path(tempfile.mkdtemp(prefix="outboxkit-bench-cli-"))
    runs: dict[str, list[dict[str, Any]]] = {"cli": [], "inproc": []}
    for kind in variants:
        runs[kind] = []
    kinds = list(runs)
    with kafka_broker(args.kafka) as bootstrap:
        ensure_topic(bootstrap, TOPIC)
        broker_url = f"kafka://{bootstrap}"
        for i in range(args.rounds):
            order = kinds if i % 2 == 0 else kinds[::-1]
            for kind in order:
                r = run_one(kind, args.dsn, broker_url, bootstrap, args.events, logdir, variants)
                runs[kind].append(r)
                print(
                    f"round {i + 1} {kind:7s} {r['rate']:>10,.0f} events/s"
                    f"  {r['cpu_us_per_event']:6.1f} µs CPU/event",
                    flush=True,
                )
    summary = {
        kind: {
            "median_rate": statistics.median(r["rate"] for r in rs),
            "median_cpu_us_per_event": statistics.median(r["cpu_us_per_event"] for r in rs),
            "rates": [round(r["rate"]) for r in rs],
        }
        for kind, rs in runs.items()
    }
    ratio = summary["cli"]["median_rate"] / summary["inproc"]["median_rate"]
    cpu_ratio = (
        summary["cli"]["median_cpu_us_per_event"] / summary["inproc"]["median_cpu_us_per_event"]
    )
    print(f"cli / in-process: rate {ratio:.3f}, CPU per event {cpu_ratio:.3f}")
    for kind in variants:
        other, inproc = summary[kind], summary["inproc"]
        print(
            f"{kind} / in-process: rate {other['median_rate'] / inproc['median_rate']:.3f},"
            " CPU per event"
            f" {other['median_cpu_us_per_event'] / inproc['median_cpu_us_per_event']:.3f}"
        )
    # Same-round pairs (the machine's load swings between rounds): cli over each variant.
    for kind in variants:
        pairs = [
            a["cpu_us_per_event"] / b["cpu_us_per_event"]
            for a, b in zip(runs["cli"], runs[kind], strict=True)
        ]
        print(
            f"cli / {kind}, CPU per event, per round: {[round(x, 3) for x in pairs]},"
            f" median {statistics.median(pairs):.3f}"
        )
    save(
        args.out,
        {
            "what": "outboxkit relay (CLI process, defaults) vs in-process Relay, interleaved;"
            " broker-side window (consumer: first to last message); relay process CPU",
            "events": args.events,
            "variants": variants,
            "payload_bytes": size,
            "server": server_facts(args.dsn),
            "summary": summary,
            "rate_ratio_cli_over_inproc": ratio,
            "cpu_ratio_cli_over_inproc": cpu_ratio,
            "runs": runs,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
    )


if __name__ == "__main__":
    main()
