"""The relay's HTTP side under heavy or hostile use: whatever it is asked, it keeps relaying.

Real relays (in this loop, or as processes with their own descriptor limit), real
PostgreSQL and NATS, real sockets: a scrape of a large registry, a slow-loris
flood, the default bind address and what /readyz tells whoever reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from outboxkit import Event
from outboxkit.ops.http import SCRAPE_KEY, ServerLimits, metrics_app, serving
from outboxkit.ops.metrics import RelayMetrics
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.testing import free_port, spawn_relay
from tests.support.relaying import count, running_relay, wait_for, write_events
from tests.support.servers import ensure_stream

# ----------------------------------------------------------------------------- helpers


class _LargeCollector(Collector):
    """An application's own metrics sharing the relay's registry: ~0.5 s to render."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("app_cache_entry_bytes", "An app's big gauge.", labels=["k"])
        for i in range(self.samples):
            family.add_metric([f"key-{i}"], i)
        yield family


#: A scraping process: THREADS threads GET URL for SECONDS, then print each scrape's duration.
_SCRAPER = """
import sys, threading, time, urllib.request
url, threads, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
done, end = [], time.monotonic() + seconds
def scrape():
    while time.monotonic() < end:
        started = time.monotonic()
        with urllib.request.urlopen(url, timeout=60) as resp:
            assert resp.status == 200 and b"app_cache_entry_bytes" in resp.read()
        done.append(time.monotonic() - started)
workers = [threading.Thread(target=scrape) for _ in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
print(" ".join(f"{d:.3f}" for d in done))
"""


class _LoopLag:
    """How late a 10 ms ticker wakes up: the relay's loop, measured from inside it."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (when, lateness)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.01)
            now = loop.time()
            self.samples.append((now, now - before - 0.01))

    def between(self, start: float, end: float) -> list[float]:
        return [lag for t, lag in self.samples if start <= t <= end]


def _events(topic: str, n: int) -> list[Event]:
    return [Event(topic=topic, event_type="order.placed", payload={"i": i}) for i in range(n)]


def _latency(metrics: RelayMetrics, topic: str) -> tuple[float, float]:
    """(sum, count) of the relay's publish latency histogram for ``topic``."""
    labels = {"topic": topic}
    total = metrics.registry.get_sample_value("outboxkit_publish_latency_seconds_sum", labels)
    n = metrics.registry.get_sample_value("outboxkit_publish_latency_seconds_count", labels)
    return total or 0.0, n or 0.0


def _get(url: str, timeout: float = 5.0, host: str | None = None) -> tuple[int, bytes]:
    assert url.startswith("http://127.0.0.1:")
    request = urllib.request.Request(url, headers={"Host": host} if host else {})  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ------------------------------------------------------------------ scrape off the loop


async def test_scraping_a_large_registry_under_load_does_not_stall_the_relay(
    db_dsn: str, nats_server: Any
) -> None:
    root = f"s{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    topic = f"{root}.orders"
    metrics = RelayMetrics(db_dsn, gauge_interval=0.5, process_metrics=False)
    metrics.registry.register(_LargeCollector(100_000))
    lag = _LoopLag()
    stop_writing = asyncio.Event()
    written = 0

    async def writer() -> None:
        nonlocal written
        while not stop_writing.is_set():
            await asyncio.to_thread(write_events, db_dsn, _events(topic, 20))
            written += 20
            await asyncio.sleep(0.05)

    publisher = NatsPublisher.from_url(nats_server.url)
    app = metrics_app(metrics)
    async with (
        running_relay(db_dsn, publisher, observer=metrics) as relay,
        serving(app, "127.0.0.1", 0) as site,
    ):
        metrics.attach(relay)
        url = f"http://127.0.0.1:{site.port}/metrics"
        tasks = [asyncio.create_task(lag.run()), asyncio.create_task(writer())]
        try:
            await asyncio.sleep(1.0)  # warm up
            loop = asyncio.get_running_loop()
            quiet_from, lat_quiet0 = loop.time(), _latency(metrics, topic)
            await asyncio.sleep(4.0)
            quiet_to, lat_quiet1 = loop.time(), _latency(metrics, topic)
            # Prometheus is another process: so are the scrapers (their work is not the relay's)
            scrapers = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _SCRAPER,
                url,
                "6",
                "6.0",
                stdout=asyncio.subprocess.PIPE,
            )
            out, _err = await scrapers.communicate()
            busy_to, lat_busy1 = loop.time(), _latency(metrics, topic)
            scrapes = [float(x) for x in out.split()]
            stop_writing.set()
            await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="all events published")
        finally:
            stop_writing.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    quiet = lag.between(quiet_from, quiet_to)
    busy = lag.between(quiet_to, busy_to)
    assert len(scrapes) >= 6, f"only {len(scrapes)} scrapes answered"
    renders = app[SCRAPE_KEY].renders
    quiet_p99 = statistics.quantiles(quiet, n=100)[98]
    busy_p99 = statistics.quantiles(busy, n=100)[98]
    report = (
        f"loop lag quiet p99 {quiet_p99 * 1000:.0f} ms max {max(quiet) * 1000:.0f} ms;"
        f" while scraping p99 {busy_p99 * 1000:.0f} ms max {max(busy) * 1000:.0f} ms;"
        f" {len(scrapes)} scrapes, slowest {max(scrapes):.2f}s, {renders} renders"
    )
    print(report)
    # On the loop, each render stalled it for the whole render (0.5 s and more here).
    assert max(busy) < max(0.3, 4 * max(quiet) + 0.1), report
    assert busy_p99 < max(0.15, 4 * quiet_p99 + 0.05), report
    quiet_avg = (lat_quiet1[0] - lat_quiet0[0]) / max(1.0, lat_quiet1[1] - lat_quiet0[1])
    busy_avg = (lat_busy1[0] - lat_quiet1[0]) / max(1.0, lat_busy1[1] - lat_quiet1[1])
    assert lat_busy1[1] - lat_quiet1[1] > 0, "the relay kept publishing while scraped"
    assert busy_avg < quiet_avg + 0.25, (
        f"publish latency moved: {quiet_avg:.3f}s quiet, {busy_avg:.3f}s while scraped; {report}"
    )


async def test_concurrent_scrapes_share_one_render(db_dsn: str) -> None:
    metrics = RelayMetrics(db_dsn, process_metrics=False)
    metrics.registry.register(_LargeCollector(50_000))
    app = metrics_app(metrics)
    async with serving(app, "127.0.0.1", 0) as site:
        url = f"http://127.0.0.1:{site.port}/metrics"
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(8) as clients:  # not the default executor the server uses
            results = await asyncio.gather(
                *(loop.run_in_executor(clients, _get, url, 60) for _ in range(8))
            )
    assert all(status == 200 for status, _ in results)
    assert len({body for _, body in results}) <= 2
    scrape = app[SCRAPE_KEY]
    assert scrape.renders <= 2, f"{scrape.renders} renders for 8 concurrent scrapes"


# ------------------------------------------------------------------------- slow loris


async def _slow_loris(port: int, stop: asyncio.Event, stats: dict[str, int]) -> None:
    """One attacker connection: a request that never ends its headers; reconnects when cut."""
    while not stop.is_set():
        writer = None
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            stats["opened"] += 1
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            await writer.drain()
            while not stop.is_set():
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(1024), timeout=2.0) == b"":
                        break  # the server closed it
        except OSError:
            stats["failed"] += 1
            await asyncio.sleep(0.2)
        finally:
            if writer is not None:
                writer.close()


@contextlib.asynccontextmanager
async def _flood(port: int, connections: int) -> AsyncIterator[dict[str, int]]:
    stop = asyncio.Event()
    stats = {"opened": 0, "failed": 0}
    tasks = [asyncio.create_task(_slow_loris(port, stop, stats)) for _ in range(connections)]
    try:
        yield stats
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


def _spawn_relay_with_fd_limit(
    dsn: str, broker: str, log_path: Path, limit: int, *args: str
) -> subprocess.Popen[bytes]:
    """`outboxkit relay` as a process whose soft and hard open-file limits are ``limit``."""
    return spawn_relay(dsn, broker, log_path, *args, log_level=None, open_files=limit)


@pytest.mark.exclusive  # drives the CPUs itself: alone under xdist
async def test_slow_loris_flood_neither_starves_the_relay_nor_floods_its_log(
    db_dsn: str, nats_server: Any, tmp_path: Path
) -> None:
    root = f"l{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    topic = f"{root}.orders"
    port = free_port()
    log_path = tmp_path / "relay.log"
    # 1024 open files, as a distribution's default soft limit; 1 100 attackers
    relay = _spawn_relay_with_fd_limit(
        db_dsn,
        nats_server.url,
        log_path,
        1024,
        "--metrics-port",
        str(port),
        "--retention",
        "keep",
        "--poll-interval",
        "0.2",
        "--lease",
        "5",
    )
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_for(
            lambda: _probe(f"{base}/healthz") == 200, timeout=30, what="the relay's /healthz"
        )
        async with _flood(port, 1100) as stats:
            await asyncio.sleep(3)  # the flood is on
            probes: list[int] = []
            for _ in range(5):
                write_events(db_dsn, _events(topic, 20))
                # a kubelet's probe: up to 3 tries (its default failureThreshold)
                probes.append(await asyncio.to_thread(_probe, f"{base}/healthz", 3))
                await asyncio.sleep(3)
            await wait_for(
                lambda: count(db_dsn, "status = 1") == 100,
                timeout=30,
                what="100 events published during the flood",
            )
            assert stats["opened"] > 1100, stats
            assert relay.poll() is None, "the relay died under the flood"
            # a health probe gets through: the slowest header-senders make room for it
            assert probes.count(200) == 5, probes
            assert await asyncio.to_thread(_probe, f"{base}/healthz", 3) == 200
        published = _attempts(db_dsn)
        assert published == {1: 100}, f"events claimed more than once: {published}"
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    log = log_path.read_text()
    assert "Too many open files" not in log, log[-3000:]
    assert "socket.accept()" not in log, log[-3000:]
    assert "database unavailable" not in log, log[-3000:]
    assert len(log) < 20_000, f"{len(log)} bytes of log in 20 s: {log[-2000:]}"
    assert 1 <= log.count("connections open (the cap)") <= 3, log[-3000:]


def _probe(url: str, retries: int = 1) -> int:
    """Status of GET ``url`` (0 when the connection fails), trying a few times."""
    status = 0
    for _ in range(retries):
        try:
            status = _get(url, timeout=3)[0]
        except OSError:
            status = 0
        if status == 200:
            return status
        time.sleep(0.2)
    return status


def _attempts(dsn: str) -> dict[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT attempts, count(*) FROM outbox WHERE status = 1 GROUP BY attempts"
        ).fetchall()
    return {int(a): int(n) for a, n in rows}


async def test_header_deadline_closes_a_connection_that_never_finishes(db_dsn: str) -> None:
    metrics = RelayMetrics(db_dsn, process_metrics=False)
    limits = ServerLimits(max_connections=4, header_timeout=1.0)
    async with serving(metrics_app(metrics), "127.0.0.1", 0, limits=limits) as site:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        await writer.drain()
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""
        assert 0.8 < time.monotonic() - started < 3, "closed after the header deadline"
        writer.close()
        # five idle connections on a cap of four: the oldest is dropped, the cap holds
        idle = [await asyncio.open_connection("127.0.0.1", site.port) for _ in range(5)]
        await asyncio.sleep(0.2)
        assert site.gate.open == 4 and site.gate.dropped >= 1
        status, _body = await asyncio.to_thread(_get, f"http://127.0.0.1:{site.port}/healthz")
        assert status == 200, "a real request still gets in"
        for _r, w in idle:
            w.close()


# --------------------------------------------------------------------- bind and readyz


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the LISTEN sockets on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(name) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


def test_relay_metrics_and_dashboard_listen_on_loopback_by_default(
    db_dsn: str, nats_server: Any, tmp_path: Path
) -> None:
    port = free_port()
    log_path = tmp_path / "relay.log"
    relay = _spawn_relay_with_fd_limit(
        db_dsn, nats_server.url, log_path, 4096, "--metrics-port", str(port), "--dashboard"
    )
    try:
        deadline = time.monotonic() + 30
        while not _listening_addresses(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        # 0100007F: 127.0.0.1 as /proc/net/tcp writes it; 0.0.0.0 would be 00000000
        assert _listening_addresses(port) == {"0100007F"}, log_path.read_text()[-2000:]
        assert _get(f"http://127.0.0.1:{port}/dashboard/")[0] == 200
        status, body = _get(f"http://127.0.0.1:{port}/dashboard/", host=f"evil.example:{port}")
        assert status == 403 and b"--allow-host" in body, "a rebound name is refused"
    finally:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0, log_path.read_text()[-3000:]
    help_text = subprocess.run(
        [sys.executable, "-m", "outboxkit", "relay", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "0.0.0.0" not in help_text.split("--metrics-host")[1].split("--")[0].split("default")[-1]


async def test_readyz_says_why_without_naming_servers_hosts_or_roles(
    db_dsn: str, nats_server: Any, proxy_factory: Any, tmp_path: Path
) -> None:
    root = f"r{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    pg = urllib.parse.urlsplit(db_dsn)
    assert pg.port is not None
    nats = urllib.parse.urlsplit(nats_server.url)
    assert nats.port is not None
    db_proxy = proxy_factory("127.0.0.1", pg.port)
    nats_proxy = proxy_factory("127.0.0.1", nats.port)
    dsn = pg._replace(netloc=f"{pg.username}@127.0.0.1:{db_proxy.port}").geturl()
    port = free_port()
    log_path = tmp_path / "relay.log"
    relay = _spawn_relay_with_fd_limit(
        dsn,
        f"nats://127.0.0.1:{nats_proxy.port}?timeout=1",
        log_path,
        4096,
        "--metrics-port",
        str(port),
        "--gauge-interval",
        "0.3",
        "--poll-interval",
        "0.2",
    )
    secrets = {
        "127.0.0.1",
        str(db_proxy.port),
        str(nats_proxy.port),
        str(pg.username),
        "server",
        "host",
        "role",
        "nats://",
    }
    url = f"http://127.0.0.1:{port}/readyz"
    try:
        await wait_for(lambda: _probe(url) == 200, timeout=30, what="/readyz 200")
        db_proxy.cut()
        await wait_for(lambda: _probe(url) == 503, timeout=15, what="/readyz 503, database cut")
        body = _get(url)[1].decode()
        assert body.startswith("not ready: database unreachable ("), body
        assert not {s for s in secrets if s in body.lower()}, body
        db_proxy.resume()
        await wait_for(lambda: _probe(url) == 200, timeout=20, what="/readyz 200 again")
        nats_proxy.cut()
        write_events(db_dsn, _events(f"{root}.x", 3))
        await wait_for(lambda: _probe(url) == 503, timeout=20, what="/readyz 503, broker cut")
        body = _get(url)[1].decode()
        # the client's disconnect (unreachable) or the failed batch (not confirming), first
        assert body.startswith(
            ("not ready: broker not confirming (", "not ready: broker unreachable for ")
        ), body
        assert not {s for s in secrets if s in body.lower()}, body
        nats_proxy.resume()
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    log = log_path.read_text()
    assert "not ready: database unreachable" in log, "the details go to the relay's log"


# A server out of descriptors: every one is taken, so accept() fails with EMFILE.
_STARVED_SERVER = """
import asyncio, logging, os, resource, sys
from aiohttp import web
from outboxkit.ops import http
from outboxkit.ops.http import serving
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
if len(sys.argv) > 3:
    http._LOG_EVERY = float(sys.argv[3])  # seconds between two lines about failing accepts
async def main():
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    async with serving(web.Application(), "127.0.0.1", int(sys.argv[1])):
        hog = []
        try:
            while True:
                hog.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        print("starved", flush=True)
        await asyncio.sleep(float(sys.argv[2]))
asyncio.run(main())
"""


async def _starve(seconds: float, *log_every: str) -> tuple[str, int]:
    """Run a server out of descriptors while clients knock for ``seconds``: its log, knocks."""
    port = free_port()
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _STARVED_SERVER,
        str(port),
        str(seconds + 2),
        *log_every,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert server.stdout is not None
    assert await asyncio.wait_for(server.stdout.readline(), 30) == b"starved\n"
    deadline = time.monotonic() + seconds
    attempts = 0
    while time.monotonic() < deadline:  # clients keep knocking; each accept fails
        with contextlib.suppress(OSError, TimeoutError):
            _r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1)
            w.close()
        attempts += 1
        await asyncio.sleep(0.05)
    _out, err = await server.communicate()
    log = err.decode()
    assert server.returncode == 0, log[-2000:]
    return log, attempts


async def test_accept_errors_out_of_descriptors_are_logged_once_per_interval() -> None:
    log, attempts = await _starve(6)
    # asyncio's own handler wrote one traceback per failed accept (one per second here)
    assert log.count("socket.accept() out of system resource") == 1, log[-3000:]
    assert "Too many open files" in log and "Traceback" not in log, log[-3000:]
    assert attempts > 20


async def test_failed_accepts_are_counted_once_per_retry_not_once_per_accept_call() -> None:
    """Before: "(4 755 more since the last such line)" after 30 s of a starved relay.

    asyncio's accept loop goes on after EMFILE: up to `backlog` (128) failing accept()
    calls in one loop tick, each reported. One tick is one failure; asyncio retries the
    socket once a second, so a second of starvation counts about one.
    """
    log, _attempts = await _starve(5, "2.0")
    lines = log.count("socket.accept() out of system resource")
    held = [int(n) for n in re.findall(r"\((\d+) more since the last such line\)", log)]
    assert 2 <= lines <= 4 and held, log[-3000:]
    # 5 s of knocking (plus the server's last 2 s): one count per second at most
    assert lines + sum(held) <= 8, f"held-back counts {held}: one per accept() call"
    assert "ulimit -n" in log, "the line says what to do"
