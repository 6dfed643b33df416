"""One way to measure a relay's CPU per event, used by every relay benchmark (issue 24).

Every contender (``outboxkit relay``, a bare script running ``Relay``, and the two floors:
a bare idempotent producer and a bare lease-claim-delete SQL loop) runs as a **child
process** on rows preloaded by the parent. A consumer in the parent (``Watch``) reads the
topic: the rate is first message to last, from the broker's side (item 1's window). When
the last message arrives the child gets SIGTERM (a relay then settles what is in flight and
exits; a floor has already exited) and the parent reaps it with ``wait4``, whose rusage is
the child's CPU over its whole life, every thread included (librdkafka's, psycopg's none).

**CPU per event is a difference of two runs of the same contender**: one on ``n`` rows, one
on ``n0`` rows (default n / 10), ``(cpu(n) - cpu(n0)) / (n - n0)``. What does not grow with
the event count cancels exactly: interpreter start-up, imports, ``gc.freeze``, connecting,
the table check, the idempotent producer's id handshake, the first claim's wait, shutdown.
The broker's and PostgreSQL's CPU over the child's life are differenced the same way
("own" = child + broker + PostgreSQL). The floors load all ``n`` messages in both runs,
so their set-up cancels too.

Why not a window on the child's CPU (read at the first and the last message, as
``cli_relay.py`` and ``relay_throughput.py --cli`` did until 2026-12-01): the work before
the first message reaches the watcher (up to ``max_in_flight`` batches claimed, decoded
and produced) and the last settles fall outside it while the n events count, and the
in-process contender of ``relay_throughput.py`` was metered by another window (first
produce to last settle, in the bench process, with no watcher loading the broker and the
cores). The two scripts disagreed by 1.05 against 1.2-1.7; see docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from _common import TOPIC, broker_pid, reload

from outboxkit.testing import spawn_relay

HERE = Path(__file__).parent

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
    """Consume ``topic`` from its end; note when the first and the n-th new message arrive
    (and call ``on_last`` then)."""

    def __init__(
        self,
        bootstrap: str,
        n: int,
        on_last: Callable[[], None] | None = None,
        cpu: Callable[[], float] | None = None,
        topic: str = TOPIC,
    ) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self.n, self.count = n, 0
        self.first = self.last = 0.0
        self.on_last = on_last
        # The child's CPU when the first and the last message arrive: the old window, kept
        # to show what it missed (docs/benchmarks.md, round 3, third session).
        self._cpu = cpu
        self.cpu_first = self.cpu_last = 0.0
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-{os.getpid()}-{time.monotonic_ns()}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 10,
            }
        )
        _low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        self._consumer.assign([TopicPartition(topic, 0, high)])
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

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while self.count < self.n:
            msgs = self._consumer.consume(10_000, 0.05)
            if not msgs:
                continue
            now = time.perf_counter()
            got = sum(1 for m in msgs if m.error() is None)
            if self.count == 0 and got:
                self.first = now
                self.cpu_first = self._cpu() if self._cpu else 0.0
            self.count += got
        self.last = time.perf_counter()
        self.cpu_last = self._cpu() if self._cpu else 0.0
        if self.on_last is not None:
            self.on_last()
        self._done.set()

    def wait(self, timeout: float) -> bool:
        ok = self._done.wait(timeout)
        if ok:  # (closing it under the consuming thread hangs librdkafka: left to exit)
            self._consumer.close()
        return ok


class OwnCpu:
    """CPU seconds of the broker process and the whole PostgreSQL server (postmaster, live
    backends, and exited ones through the postmaster's children counters), and the machine's."""

    def __init__(self, bootstrap: str, dsn: str) -> None:
        import psutil

        self._psutil = psutil
        pid = broker_pid(bootstrap)
        self._broker = psutil.Process(pid) if pid else None
        port = int(psycopg.conninfo.conninfo_to_dict(dsn).get("port") or 5432)
        pg = broker_pid(f"127.0.0.1:{port}")
        self._pg = psutil.Process(pg) if pg else None

    def read(self) -> tuple[float, float, float]:
        t = self._psutil.cpu_times()
        machine = t.user + t.system + t.nice + t.irq + t.softirq
        broker = sum(self._broker.cpu_times()[:2]) if self._broker else 0.0
        pg = 0.0
        if self._pg is not None:
            p = self._pg.cpu_times()
            pg = p.user + p.system + p.children_user + p.children_system
            for child in self._pg.children():
                with contextlib.suppress(Exception):  # exited since listed: in children_*
                    pg += sum(child.cpu_times()[:2])
        return machine, broker, pg


def _command(
    kind: str,
    dsn: str,
    bootstrap: str,
    n: int,
    total: int,
    src: str | None,
    ready: Path,
    args: tuple[str, ...] = (),
) -> Any:
    """Start contender ``kind``; its Popen."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    log = Path(tempfile.gettempdir()) / f"outboxkit-bench-{kind}.log"
    broker_url = f"kafka://{bootstrap}"
    # An option may name the broker itself: --broker 'kafka://{bootstrap}?linger_ms=5'.
    args = tuple(a.replace("{bootstrap}", bootstrap) for a in args)
    if kind == "cli" or kind.startswith("cli_"):
        return spawn_relay(
            dsn, broker_url, log, *args, log_level=None, env={"PYTHONPATH": src} if src else None
        )
    out = log.open("ab")
    if kind == "inproc" or kind.startswith("inproc_"):
        argv = [sys.executable, "-c", INPROC, dsn, broker_url]
    elif kind in ("producer", "producer_window", "producer_paced", "sql"):
        argv = [sys.executable, str(HERE / "_floors.py"), kind, dsn, bootstrap, str(n), str(total)]
        argv.append(str(ready))
    else:
        raise ValueError(kind)
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)


def run_child(
    kind: str,
    dsn: str,
    bootstrap: str,
    n: int,
    total: int,
    own: OwnCpu,
    src: str | None = None,
    args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One life of contender ``kind`` on ``n`` preloaded rows (or, for the producer floor,
    ``n`` of ``total`` messages it loads): its whole-life CPU and the broker-side window."""
    if not kind.startswith("producer"):  # (the producer floors send what they load)
        reload(dsn, limit=n)
    child: subprocess.Popen[bytes] | None = None

    def stop() -> None:
        if child is not None and not kind.startswith("producer") and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    def child_cpu() -> float:
        import psutil

        with contextlib.suppress(psutil.Error):  # (a floor may have exited)
            t = psutil.Process(child.pid if child else 0).cpu_times()
            return float(t.user + t.system)
        return float("nan")

    watch = Watch(bootstrap, n, stop, child_cpu) if kind != "sql" else None
    ready = Path(tempfile.mkdtemp(prefix="outboxkit-bench-")) / "ready"
    before = own.read()
    child = _command(kind, dsn, bootstrap, n, total, src, ready, args)
    if watch is not None:
        watch.start()
        if not watch.wait(300):
            child.kill()
            raise RuntimeError(f"{kind}: {watch.count} of {n} events in 300 s")
    _pid, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    time.sleep(0.05)  # the postmaster reaps the child's backend
    after = own.read()
    if child.returncode not in (0, -signal.SIGTERM):
        raise RuntimeError(f"{kind} exited with {child.returncode}")
    machine, broker, pg = (b - a for a, b in zip(before, after, strict=True))
    # A floor's set-up (its CPU when it wrote READY) is not the floor's work.
    setup = float(ready.read_text()) if ready.exists() else 0.0
    out: dict[str, Any] = {
        "kind": kind,
        "events": n,
        "setup_cpu_s": setup,
        "cpu_s": usage.ru_utime + usage.ru_stime - setup,
        "broker_s": broker,
        "postgres_s": pg,
        "machine_s": machine,
    }
    if watch is not None:
        out["window_s"] = watch.last - watch.first
        out["rate"] = (n - 1) / out["window_s"] if out["window_s"] > 0 else None
        out["stale_skipped"] = watch.stale
        out["window_cpu_us_per_event"] = (watch.cpu_last - watch.cpu_first) * 1e6 / (n - 1)
    return out


def per_event(big: dict[str, Any], small: dict[str, Any]) -> dict[str, float]:
    """µs per event from two lives of one contender: the difference over the extra events."""
    d = big["events"] - small["events"]
    out = {
        key: (big[f"{key}_s"] - small[f"{key}_s"]) * 1e6 / d
        for key in ("cpu", "broker", "postgres", "machine")
    }
    out["own"] = out["cpu"] + out["broker"] + out["postgres"]
    return out


def measure(
    kind: str,
    dsn: str,
    bootstrap: str,
    n: int,
    n0: int,
    own: OwnCpu,
    src: str | None = None,
    args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Contender ``kind`` on n0 rows, then on n; µs per event from the difference, and the
    rate of the n run (broker side)."""
    small = run_child(kind, dsn, bootstrap, n0, n, own, src, args)
    big = run_child(kind, dsn, bootstrap, n, n, own, src, args)
    return {
        "kind": kind,
        "rate": big.get("rate"),
        "us": per_event(big, small),
        "runs": [small, big],
    }
