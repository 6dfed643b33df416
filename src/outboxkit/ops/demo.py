"""``outboxkit demo``: the dual-write problem and the outbox side by side, under real faults.

One order service places orders at a steady rate through two paths: the naive
"commit, then publish" and the outbox. Meanwhile the broker goes down and comes
back, and one of two relays is SIGKILLed while it holds a claimed batch. A
consumer that deduplicates by event id counts what arrived. Nothing is
simulated: PostgreSQL and NATS JetStream are real servers (embedded from wheels
unless the user passes their own), relays are OS processes, faults are signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import click
import orjson
import psycopg
from psycopg import sql
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from outboxkit._redact import redact
from outboxkit.errors import OutboxkitError
from outboxkit.events import Event
from outboxkit.store.migrate import migrate
from outboxkit.store.postgres import Statements
from outboxkit.write import Outbox

log = logging.getLogger("outboxkit.demo")

TABLE = "outbox"
RELAYS = ("relay-a", "relay-b")
VICTIM = "relay-a"
# Faults as fractions of the order phase: the broker is down for a fifth of it.
BROKER_DOWN_AT, BROKER_UP_AT, RELAY_KILL_AT = 0.25, 0.45, 0.65
LEASE_S = 3.0  # short, so the killed relay's claim expires and is re-claimed within the demo
NAIVE_PUBLISH_TIMEOUT_S = 1.0
DRAIN_TIMEOUT_S = 20.0
DUPLICATE_WINDOW_S = 120.0

# Relays run with the demo's compressed clock: small batches so a kill lands
# mid-batch, a short lease, and a short retry cap with a large attempt budget,
# which tolerates an outage as long as the production defaults do.
RELAY_OPTIONS = (
    f"--table {TABLE} --lease {LEASE_S:g} --poll-interval 0.5 --batch-size 20"
    " --retry-base 0.2 --retry-cap 1 --max-attempts 1000 --shutdown-timeout 5"
).split()

CREATE_ORDERS = """
CREATE TABLE orders (
    id           bigserial PRIMARY KEY,
    path         text NOT NULL,  -- which write path placed the order: naive or outbox
    customer     text NOT NULL,
    amount_cents int NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
)
"""
INSERT_ORDER = "INSERT INTO orders (path, customer, amount_cents) VALUES (%s, %s, %s) RETURNING id"
ORDERS_BY_PATH = "SELECT path, id FROM orders"
# Rows a relay holds right now: claimed by it, lease not expired, not settled.
HELD_BY_RELAY = """
SELECT event_id FROM {table}
WHERE claimed_by = %s AND claim_token IS NOT NULL AND status = 0 AND available_at > now()
"""
STILL_PENDING = "SELECT count(*) FROM {table} WHERE event_id = ANY(%s) AND status = 0"
RELAYS_CONNECTED = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'outboxkit-relay:claim'
"""


class _Server(Protocol):
    def start(self) -> None: ...
    def close(self) -> None: ...


# -- results ------------------------------------------------------------------------


@dataclass
class _PathStats:
    """What one write path did, by event id: when it committed, when it arrived."""

    committed_at: dict[str, float] = field(default_factory=dict)
    received_at: dict[str, float] = field(default_factory=dict)
    delivered_orders: set[int] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)
    redeliveries: int = 0  # copies the consumer's dedup dropped
    publish_errors: int = 0  # naive only: publishes that failed, logged and forgotten


@dataclass
class _PathResult:
    committed: int
    delivered: int
    lost: int
    duplicates_absorbed: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "delivered": self.delivered,
            "lost": self.lost,
            "duplicates_absorbed": self.duplicates_absorbed,
            "latency_p50_ms": self.latency_p50_ms,
            "latency_p99_ms": self.latency_p99_ms,
            **self.extra,
        }


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


# -- a cuttable TCP proxy --------------------------------------------------------------


class _Proxy:
    """A loopback TCP proxy in front of a broker the demo does not own, so it can cut it.

    ``cut`` closes the listener and resets every connection: to the clients
    that is the broker going away; ``restore`` listens on the same port again.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        if self._handlers:  # they end at once on the reset; do not leave them to the loop
            await asyncio.wait(self._handlers, timeout=2.0)
        if server is not None:
            await server.wait_closed()

    async def restore(self) -> None:
        await self.start()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(*self._upstream), 5.0)
        except (OSError, TimeoutError):
            client_w.transport.abort()
            return
        pair = {client_w, up_w}
        self._writers |= pair
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
        try:
            await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
        finally:
            self._writers -= pair
            self._handlers.discard(handler)
            for writer in pair:
                writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        # Half of the pair is gone: close the other side so its reader sees EOF too.
        writer.close()


# -- the demo ----------------------------------------------------------------------------


class _Demo:
    """Runs the two write paths, the faults, the consumer and the progress display."""

    def __init__(self, *, orders: int, duration: float, progress: Console) -> None:
        self.orders = orders
        self.duration = duration
        self.console = progress
        self.live: Live | None = None
        self.naive = _PathStats()
        self.outbox = _PathStats()
        self.phase = "starting servers"
        self.notes: list[tuple[float, str]] = []
        self.backlog = 0
        self.dead_letters = 0
        self.relays: dict[str, asyncio.subprocess.Process] = {}
        self.relay_codes: dict[str, int | None] = {}
        self.kill: dict[str, Any] = {}
        self.server_start_s = 0.0
        self.started = time.monotonic()
        self.t0 = self.started  # start of the order phase, set when it begins
        self._rng = random.Random()
        self._outbox_writer = Outbox(TABLE)
        self._naive_tasks: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._naive_js: Any = None
        self.outbox_subject = self.naive_subject = ""
        self._sql = Statements(TABLE)
        self._held_by = sql.SQL(HELD_BY_RELAY.format(table=self._sql.qualified))
        self._still_pending = sql.SQL(STILL_PENDING.format(table=self._sql.qualified))

    # -- progress ------------------------------------------------------------------

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    def note(self, text: str, *, phase: str | None = None) -> None:
        """Record a fault or phase change; without a live display, print it as a line."""
        at = self._elapsed()
        if phase is not None:
            self.phase = phase
        self.notes.append((at, text))
        if self.live is None:
            self.console.print(
                f"[{at:5.1f}s] {text}  (orders naive/outbox {len(self.naive.committed_at)}"
                f"/{len(self.outbox.committed_at)}, delivered {len(self.naive.received_at)}"
                f"/{len(self.outbox.received_at)}, outbox backlog {self.backlog})",
                markup=False,
                highlight=False,
            )

    def render(self) -> RenderableType:
        head = Text.assemble(
            ("outboxkit demo", "bold"),
            f"  {self.orders} orders per path over {self.duration:g}s   ",
            (f"{max(0.0, self._elapsed()):5.1f}s", "cyan"),
            "   phase: ",
            (self.phase, "bold yellow" if "down" in self.phase else "bold"),
        )
        grid = Table(box=None, padding=(0, 2), show_edge=False)
        grid.add_column("")
        grid.add_column("naive dual write", justify="right")
        grid.add_column("outbox", justify="right")
        grid.add_row(
            "orders committed",
            str(len(self.naive.committed_at)),
            str(len(self.outbox.committed_at)),
        )
        grid.add_row(
            "events delivered", str(len(self.naive.received_at)), str(len(self.outbox.received_at))
        )
        grid.add_row("publish errors (logged, dropped)", str(self.naive.publish_errors), "-")
        grid.add_row("outbox backlog", "-", str(self.backlog))
        lines = [Text(f"[{at:5.1f}s] {text}", style="dim") for at, text in self.notes[-8:]]
        return Group(head, grid, *lines)

    async def _refresh(self) -> None:
        while True:
            if self.live is not None:
                self.live.update(self.render(), refresh=True)
            await asyncio.sleep(0.25)

    @contextlib.asynccontextmanager
    async def display(self) -> AsyncIterator[None]:
        """A live view on a terminal; a line per phase change in CI logs."""
        if not self.console.is_terminal:
            yield
            return
        self.live = Live(self.render(), console=self.console, auto_refresh=False)
        self.live.start()
        refresher = asyncio.create_task(self._refresh())
        try:
            yield
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            self.live.update(self.render(), refresh=True)
            self.live.stop()
            self.live = None

    # -- set-up --------------------------------------------------------------------

    def run(self, broker: str | None, dsn: str | None) -> dict[str, Any]:
        """Start what is missing, run the scenario, clean everything up, return the report."""
        logs = Path(tempfile.mkdtemp(prefix="outboxkit-demo-logs-"))
        keep_logs = False
        try:
            with contextlib.ExitStack() as stack:
                work = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix="outboxkit-demo-"))
                )
                pg, nats_server = _embedded_servers(
                    work, want_pg=dsn is None, want_nats=broker is None
                )
                for server in (pg, nats_server):
                    if server is not None:  # close() also deletes PostgreSQL's data directory
                        stack.callback(_quietly, server.close)
                started = time.monotonic()
                self._start_servers(pg, nats_server)
                self.server_start_s = time.monotonic() - started
                server_dsn = dsn if dsn is not None else str(_attr(pg, "dsn"))
                broker_url = broker if broker is not None else str(_attr(nats_server, "url"))
                try:
                    report = asyncio.run(self._main(server_dsn, broker_url, nats_server, logs))
                except Exception:
                    keep_logs = True  # the error message points at them
                    raise
            keep_logs = not report["ok"]
            if keep_logs:
                report["relay_logs"] = str(logs)
            return report
        finally:
            if not keep_logs:
                shutil.rmtree(logs, ignore_errors=True)

    def _start_servers(self, pg: _Server | None, nats_server: _Server | None) -> None:
        """Start both at once: PostgreSQL's initdb dominates the demo's start-up time."""
        named = [(n, s) for n, s in (("PostgreSQL", pg), ("NATS JetStream", nats_server)) if s]
        if not named:
            return
        servers = [s for _n, s in named]
        names = " and ".join(n for n, _s in named)
        self.console.print(f"starting embedded {names} …", markup=False, highlight=False)
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            futures = [pool.submit(s.start) for s in servers]
            for (name, _server), future in zip(named, futures, strict=True):
                try:
                    future.result()
                except OutboxkitError as exc:
                    raise OutboxkitError(_cannot_embed(name, exc)) from None

    async def _main(
        self, server_dsn: str, broker_url: str, nats_server: Any, logs: Path
    ) -> dict[str, Any]:
        from nats.js.api import ConsumerConfig, StorageType

        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()
        assert main_task is not None
        loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
        async with contextlib.AsyncExitStack() as stack:
            dsn = await _create_database(server_dsn)
            stack.push_async_callback(_drop_database, server_dsn, dsn)
            await asyncio.to_thread(migrate, dsn, table=TABLE)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await conn.execute(CREATE_ORDERS)

            # A broker the user runs cannot be stopped by us: cut a proxy in front of it.
            proxy: _Proxy | None = None
            client_url = broker_url
            if nats_server is None:
                proxy, client_url = await _proxy_for(broker_url)
                stack.push_async_callback(proxy.cut)
            suffix = "" if nats_server is not None else "_" + secrets.token_hex(3)
            stream, prefix = f"DEMO{suffix.upper()}", f"demo{suffix}"
            self.outbox_subject = f"{prefix}.outbox.order.placed"
            self.naive_subject = f"{prefix}.naive.order.placed"
            subjects = [f"{prefix}.outbox.>", f"{prefix}.naive.>"]

            admin = await _nats_connect(client_url, "outboxkit-demo-admin")
            stack.push_async_callback(_close_nats, admin)
            js_admin = admin.jetstream()
            await js_admin.add_stream(
                name=stream,
                subjects=subjects,
                storage=StorageType.FILE,
                duplicate_window=DUPLICATE_WINDOW_S,
                max_age=3600.0,
            )
            if nats_server is None:
                stack.push_async_callback(_delete_stream, js_admin, stream)

            consumer = await _nats_connect(client_url, "outboxkit-demo-consumer")
            stack.push_async_callback(_close_nats, consumer)
            await consumer.jetstream().subscribe(
                f"{prefix}.>",
                stream=stream,
                durable="demo-consumer",
                cb=self._on_message,
                manual_ack=True,
                config=ConsumerConfig(ack_wait=5.0, max_ack_pending=100_000),
            )
            # Naive code wants to know whether its publish worked, so its client does
            # not buffer while disconnected: a buffer only moves the loss to the next
            # crash or overflow, and would hide it inside a demo this short.
            naive_nc = await _nats_connect(client_url, "outboxkit-demo-naive", pending_size=0)
            stack.push_async_callback(_close_nats, naive_nc)
            self._naive_js = naive_nc.jetstream()

            relay_broker = (
                f"{client_url.split('?')[0]}?stream={stream}&subjects={','.join(subjects)}"
            )
            stack.push_async_callback(self._reap_relays)
            for name in RELAYS:
                self.relays[name] = await _spawn_relay(
                    name, dsn, relay_broker, logs / f"{name}.log"
                )

            self._outbox_conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            stack.push_async_callback(self._outbox_conn.close)
            self._naive_conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            stack.push_async_callback(self._naive_conn.close)
            self._monitor_conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            stack.push_async_callback(self._monitor_conn.close)
            await self._wait_for_relays(logs)

            async with self.display():
                monitor = asyncio.create_task(self._monitor())
                try:
                    await self._scenario(nats_server, proxy)
                finally:
                    monitor.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await monitor
            await self._stop_relays()
            return await self._report(broker_url, external=nats_server is None)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _wait_for_relays(self, logs: Path) -> None:
        """Start the clock only once both relays have connected, so latencies are fair."""
        deadline = time.monotonic() + 20.0
        while True:
            cur = await self._monitor_conn.execute(RELAYS_CONNECTED)
            row = await cur.fetchone()
            if row is not None and row[0] >= len(RELAYS):
                return
            for name, proc in self.relays.items():
                if proc.returncode is not None:
                    raise OutboxkitError(
                        f"{name} exited with code {proc.returncode} at start-up;"
                        f" see its log in {logs}"
                    )
            if time.monotonic() > deadline:
                raise OutboxkitError(f"relays did not connect within 20s; see their logs in {logs}")
            await asyncio.sleep(0.1)

    # -- the scenario ----------------------------------------------------------------

    async def _scenario(self, nats_server: Any, proxy: _Proxy | None) -> None:
        self.t0 = time.monotonic()
        rate = self.orders / self.duration
        self.note(
            f"placing {rate:.0f} orders/s through each path; relay-a and relay-b running",
            phase="steady",
        )
        orders = asyncio.gather(self._place_orders("naive"), self._place_orders("outbox"))
        faults = asyncio.ensure_future(self._faults(nats_server, proxy))
        try:
            await orders
            self.note("all orders placed; waiting for the outbox to drain", phase="draining")
            await faults
            await self._drain()
            if self._watcher is not None:
                # It polls every 0.1s: let it report the takeover the drain just saw.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._watcher), 0.5)
        finally:
            for task in (orders, faults, self._watcher):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def _faults(self, nats_server: Any, proxy: _Proxy | None) -> None:
        await self._sleep_until(BROKER_DOWN_AT)
        if proxy is not None:
            await proxy.cut()
            what = "connections to your broker cut at the proxy"
        else:
            await asyncio.to_thread(nats_server.stop)
            what = "nats-server stopped"
        self.note(
            f"broker DOWN ({what}): naive publishes fail, the outbox keeps the events",
            phase="broker down",
        )
        await self._sleep_until(BROKER_UP_AT)
        if proxy is not None:
            await proxy.restore()
        else:
            await asyncio.to_thread(nats_server.start)
        self.note("broker back: relays publish the backlog", phase="broker back")
        await self._sleep_until(RELAY_KILL_AT)
        await self._kill_mid_batch(VICTIM)

    async def _sleep_until(self, fraction: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 + fraction * self.duration - time.monotonic()))

    async def _kill_mid_batch(self, name: str) -> None:
        """SIGKILL ``name`` while it holds a claim: freeze it, check, then kill.

        SIGSTOP first, because a batch is claimed, published and settled within
        milliseconds: a kill sent on sight could land after the settle.
        """
        proc = self.relays[name]
        deadline = time.monotonic() + 5.0
        held: list[uuid.UUID] = []
        while time.monotonic() < deadline:
            if await self._held(name):
                os.kill(proc.pid, signal.SIGSTOP)
                await asyncio.sleep(0.1)  # a statement already sent completes meanwhile
                held = await self._held(name)
                if held:
                    break
                os.kill(proc.pid, signal.SIGCONT)
            await asyncio.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)  # kills a stopped process too
        await proc.wait()
        killed_at = self._elapsed()
        await asyncio.sleep(0.3)  # let anything it published before dying arrive
        ids = {str(e) for e in held}
        published = len(ids & self.outbox.received_at.keys())
        self.kill = {
            "relay": name,
            "at_s": round(killed_at, 2),
            "held_events": len(held),
            "already_published": published,
        }
        if held:
            self.note(
                f"{name} SIGKILLed mid-batch holding {len(held)} claimed event(s),"
                f" {published} already published but not settled; relay-b carries on",
                phase=f"{name} killed",
            )
            self._watcher = asyncio.create_task(self._watch_takeover(held, killed_at))
        else:
            self.note(
                f"{name} SIGKILLed (it held no claim within 5s); relay-b carries on",
                phase=f"{name} killed",
            )

    async def _held(self, relay: str) -> list[uuid.UUID]:
        cur = await self._monitor_conn.execute(self._held_by, (relay,))
        return [row[0] for row in await cur.fetchall()]

    async def _watch_takeover(self, held: list[uuid.UUID], killed_at: float) -> None:
        deadline = time.monotonic() + LEASE_S + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(psycopg.Error):
                cur = await self._monitor_conn.execute(self._still_pending, (held,))
                row = await cur.fetchone()
                if row is not None and row[0] == 0:
                    after = self._elapsed() - killed_at
                    self.kill["taken_over_after_s"] = round(after, 2)
                    self.note(
                        f"relay-b re-claimed {VICTIM}'s {len(held)} event(s) when the lease"
                        f" expired and published them ({after:.1f}s after the kill)"
                    )
                    return
            await asyncio.sleep(0.1)

    async def _place_orders(self, path: str) -> None:
        interval = self.duration / self.orders
        for i in range(self.orders):
            delay = self.t0 + i * interval - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            customer = f"customer-{self._rng.randrange(1, 200)}"
            amount = self._rng.randrange(500, 50_000)
            if path == "outbox":
                await self._order_with_outbox(customer, amount)
            else:
                await self._order_with_dual_write(customer, amount)

    async def _order_with_outbox(self, customer: str, amount: int) -> None:
        conn = self._outbox_conn
        async with conn.transaction():
            cur = await conn.execute(INSERT_ORDER, ("outbox", customer, amount))
            order_id = _first(await cur.fetchone())
            event = _order_event(self.outbox_subject, order_id, customer, amount)
            await self._outbox_writer.aput(conn, event)
        self.outbox.committed_at[str(event.event_id)] = time.monotonic()

    async def _order_with_dual_write(self, customer: str, amount: int) -> None:
        conn = self._naive_conn
        async with conn.transaction():
            cur = await conn.execute(INSERT_ORDER, ("naive", customer, amount))
            order_id = _first(await cur.fetchone())
        event = _order_event(self.naive_subject, order_id, customer, amount)
        self.naive.committed_at[str(event.event_id)] = time.monotonic()
        # The request handler awaits its publish; other requests do not wait for it.
        task = asyncio.create_task(self._publish_naively(event))
        self._naive_tasks.add(task)
        task.add_done_callback(self._naive_tasks.discard)

    async def _publish_naively(self, event: Event) -> None:
        """Commit-then-publish as naive code does it: a failed publish is logged and forgotten."""
        event_id = str(event.event_id)
        try:
            await self._naive_js.publish(
                event.topic,
                event.payload,
                timeout=NAIVE_PUBLISH_TIMEOUT_S,
                headers={"Nats-Msg-Id": event_id},
            )
        except Exception as exc:
            self.naive.publish_errors += 1
            log.debug("publish of %s failed, moving on: %s", event_id, type(exc).__name__)
        else:
            self.naive.acked.add(event_id)

    async def _on_message(self, msg: Any) -> None:
        """The consumer: dedup by event id, count, measure commit-to-delivery latency."""
        now = time.monotonic()
        stats = self.outbox if msg.subject == self.outbox_subject else self.naive
        headers = msg.headers or {}
        event_id = headers.get("Nats-Msg-Id") or headers.get("ce-id")
        if event_id is not None:
            if event_id in stats.received_at:
                stats.redeliveries += 1
            else:
                stats.received_at[event_id] = now
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    stats.delivered_orders.add(int(orjson.loads(msg.data)["order_id"]))
        with contextlib.suppress(Exception):
            await msg.ack()

    async def _monitor(self) -> None:
        while True:
            with contextlib.suppress(psycopg.Error):
                cur = await self._monitor_conn.execute(self._sql.status_by_topic)
                rows = await cur.fetchall()
                self.backlog = sum(r[1] + r[2] for r in rows)
                self.dead_letters = sum(r[3] for r in rows)
            await asyncio.sleep(0.25)

    async def _drain(self) -> None:
        """Wait until the outbox is empty and the consumer has every event it can get."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            cur = await self._monitor_conn.execute(self._sql.status_by_topic)
            rows = await cur.fetchall()
            self.backlog = sum(r[1] + r[2] for r in rows)
            outbox_done = self.backlog == 0 and (
                self.outbox.committed_at.keys() <= self.outbox.received_at.keys()
            )
            naive_done = not self._naive_tasks and self.naive.acked <= self.naive.received_at.keys()
            if outbox_done and naive_done:
                self.note("outbox drained; every event the broker accepted has arrived")
                return
            await asyncio.sleep(0.1)
        self.note(f"gave up waiting after {DRAIN_TIMEOUT_S:.0f}s (outbox backlog {self.backlog})")

    # -- relays ------------------------------------------------------------------------

    async def _stop_relays(self) -> None:
        """SIGTERM the survivors: a relay finishes its batch, hands back the rest, exits 0."""
        self.phase = "stopping relays"
        for proc in self.relays.values():
            _signal(proc, signal.SIGTERM)
        for name, proc in self.relays.items():
            self.relay_codes[name] = await _wait_exit(proc, 15.0)

    async def _reap_relays(self) -> None:
        for proc in self.relays.values():
            _signal(proc, signal.SIGTERM)
        for proc in self.relays.values():
            if await _wait_exit(proc, 5.0) is None:
                _signal(proc, signal.SIGKILL)
                await _wait_exit(proc, 5.0)

    # -- the result ----------------------------------------------------------------------

    async def _report(self, broker_url: str, *, external: bool) -> dict[str, Any]:
        committed: dict[str, set[int]] = {"naive": set(), "outbox": set()}
        cur = await self._monitor_conn.execute(ORDERS_BY_PATH)
        for path, order_id in await cur.fetchall():
            committed[path].add(order_id)
        cur = await self._monitor_conn.execute(self._sql.status_by_topic)
        rows = await cur.fetchall()
        self.dead_letters = sum(r[3] for r in rows)

        def result(stats: _PathStats, orders: set[int], broker_dups: int) -> _PathResult:
            latencies = [
                max(0.0, at - stats.committed_at[e])
                for e, at in stats.received_at.items()
                if e in stats.committed_at
            ]
            return _PathResult(
                committed=len(orders),
                delivered=len(stats.received_at),
                lost=len(orders - stats.delivered_orders),
                duplicates_absorbed=stats.redeliveries + broker_dups,
                latency_p50_ms=_ms(_percentile(latencies, 0.50)),
                latency_p99_ms=_ms(_percentile(latencies, 0.99)),
            )

        naive = result(self.naive, committed["naive"], 0)
        naive.extra = {"publish_errors": self.naive.publish_errors}
        republished = int(self.kill.get("already_published", 0))
        outbox = result(self.outbox, committed["outbox"], republished)
        outbox.extra = {
            "dead_lettered": self.dead_letters,
            "duplicates_dropped_by_broker": republished,
            "duplicates_dropped_by_consumer": self.outbox.redeliveries,
        }
        relays_ok = all(self.relay_codes.get(n) == 0 for n in RELAYS if n != VICTIM)
        ok = (
            outbox.lost == 0
            and outbox.committed > 0
            and outbox.delivered == outbox.committed
            and relays_ok
        )
        return {
            "ok": ok,
            "orders_per_path": self.orders,
            "duration_s": self.duration,
            "runtime_s": round(time.monotonic() - self.started, 1),
            "server_start_s": round(self.server_start_s, 1),
            "broker": redact(broker_url) if external else "embedded NATS JetStream",
            "naive": naive.as_dict(),
            "outbox": outbox.as_dict(),
            "faults": [{"at_s": round(at, 2), "event": text} for at, text in self.notes],
            "relay_kill": self.kill,
            "relay_exit_codes": self.relay_codes,
        }


# -- helpers ---------------------------------------------------------------------------


def _first(row: tuple[Any, ...] | None) -> int:
    assert row is not None
    return int(row[0])


def _order_event(topic: str, order_id: int, customer: str, amount: int) -> Event:
    return Event(
        topic=topic,
        event_type="order.placed",
        key=customer,
        aggregate_type="order",
        aggregate_id=str(order_id),
        payload={"order_id": order_id, "customer": customer, "amount_cents": amount},
    )


def _attr(obj: Any, name: str) -> Any:
    """A property or a no-argument method (``server.dsn`` or ``server.dsn()``)."""
    value = getattr(obj, name)
    return value() if callable(value) else value


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:  # cleanup must go on; say what could not be cleaned
        log.warning("demo cleanup: %s", redact(f"{type(exc).__name__}: {exc}"))


def _embedded_servers(work: Path, *, want_pg: bool, want_nats: bool) -> tuple[Any, Any]:
    if not (want_pg or want_nats):
        return None, None
    try:
        from outboxkit.testing import EmbeddedNats, EmbeddedPostgres
    except ImportError as exc:
        raise OutboxkitError(
            f"the embedded servers are not installed ({exc}): pip install 'outboxkit[embedded]',"
            " or pass --dsn and --broker to use servers you already run"
        ) from None
    try:  # PostgreSQL makes its own data directory: under root it must be one it can reach
        pg = EmbeddedPostgres() if want_pg else None
    except OutboxkitError as exc:
        raise OutboxkitError(_cannot_embed("PostgreSQL", exc)) from None
    try:
        nats_server = EmbeddedNats(work / "nats") if want_nats else None
    except OutboxkitError as exc:
        raise OutboxkitError(_cannot_embed("NATS JetStream", exc)) from None
    return pg, nats_server


def _cannot_embed(name: str, exc: Exception) -> str:
    """One line: why the embedded server is missing, and the flag that does without it."""
    flag = "--dsn postgresql://…" if name == "PostgreSQL" else "--broker nats://…"
    return f"embedded {name} unavailable: {exc}; or pass {flag} to use a server you already run"


async def _create_database(server_dsn: str) -> str:
    """A fresh database per run, so the demo never touches anything of the user's."""
    name = f"outboxkit_demo_{secrets.token_hex(4)}"
    try:
        async with await psycopg.AsyncConnection.connect(
            server_dsn, autocommit=True, connect_timeout=10
        ) as conn:
            await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.OperationalError:
        raise
    except psycopg.Error as exc:
        raise OutboxkitError(
            f"cannot create the scratch database {name!r}: {exc};"
            " the demo needs a role allowed to CREATE DATABASE"
        ) from None
    return psycopg.conninfo.make_conninfo(server_dsn, dbname=name)


async def _drop_database(server_dsn: str, dsn: str) -> None:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    try:
        async with await psycopg.AsyncConnection.connect(
            server_dsn, autocommit=True, connect_timeout=10
        ) as conn:
            await conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(str(name)))
            )
    except psycopg.Error as exc:
        log.warning("could not drop the demo database %s: %s", name, redact(str(exc)))


def _proxy_target(broker_url: str) -> tuple[str, int]:
    parts = urlsplit(broker_url)
    if parts.scheme != "nats" or not parts.hostname:
        raise ValueError(
            "--broker must be a nats:// URL of a NATS server with JetStream enabled,"
            f" e.g. nats://127.0.0.1:4222 (got {redact(broker_url)!r})"
        )
    return parts.hostname, parts.port or 4222


async def _proxy_for(broker_url: str) -> tuple[_Proxy, str]:
    """A started proxy to the broker and the URL clients use to reach it through the proxy."""
    proxy = _Proxy(*_proxy_target(broker_url))
    parts = urlsplit(broker_url)
    await proxy.start()
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{proxy.port}" if userinfo else f"127.0.0.1:{proxy.port}"
    return proxy, urlunsplit(("nats", netloc, "", "", ""))


async def _nats_connect(url: str, name: str, **options: Any) -> Any:
    import nats

    async def quiet(*_args: Any) -> None:
        """Reconnects are the scenario, not news: keep the client's callbacks silent."""

    return await nats.connect(
        url,
        name=name,
        connect_timeout=2,
        reconnect_time_wait=0.25,
        max_reconnect_attempts=-1,
        error_cb=quiet,
        disconnected_cb=quiet,
        reconnected_cb=quiet,
        closed_cb=quiet,
        **options,
    )


async def _close_nats(nc: Any) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 5.0)


async def _delete_stream(js: Any, stream: str) -> None:
    with contextlib.suppress(Exception):
        await js.delete_stream(stream)


async def _spawn_relay(
    name: str, dsn: str, broker: str, log_path: Path
) -> asyncio.subprocess.Process:
    """``outboxkit relay`` as a real process; DSN and URL travel in the environment, not argv."""
    env = {**os.environ, "OUTBOXKIT_DSN": dsn, "OUTBOXKIT_BROKER": broker}
    env.pop("OUTBOXKIT_TABLE", None)
    with log_path.open("ab") as log_file:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "outboxkit",
            "relay",
            "--relay-id",
            name,
            *RELAY_OPTIONS,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )


def _signal(proc: asyncio.subprocess.Process, signum: int) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)


async def _wait_exit(proc: asyncio.subprocess.Process, grace: float) -> int | None:
    """The exit code, or None if the process still runs after ``grace`` seconds."""
    with contextlib.suppress(TimeoutError):
        return await asyncio.wait_for(proc.wait(), grace)
    return proc.returncode


# -- output --------------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _print_table(console: Console, report: dict[str, Any]) -> None:
    naive, outbox = report["naive"], report["outbox"]
    table = Table(title="naive dual write vs transactional outbox", title_justify="left")
    table.add_column("")
    table.add_column("naive dual write", justify="right")
    table.add_column("outbox", justify="right")
    table.add_row("orders committed", str(naive["committed"]), str(outbox["committed"]))
    table.add_row("events delivered", str(naive["delivered"]), str(outbox["delivered"]))
    table.add_row(
        "lost",
        f"[bold red]{naive['lost']}[/]" if naive["lost"] else "0",
        f"[bold red]{outbox['lost']}[/]" if outbox["lost"] else "[bold green]0[/]",
    )
    table.add_row(
        "duplicates absorbed",
        str(naive["duplicates_absorbed"]),
        str(outbox["duplicates_absorbed"]),
    )
    table.add_row("latency p50 (ms)", _fmt(naive["latency_p50_ms"]), _fmt(outbox["latency_p50_ms"]))
    table.add_row("latency p99 (ms)", _fmt(naive["latency_p99_ms"]), _fmt(outbox["latency_p99_ms"]))
    console.print()
    console.print(table)
    mark = "[bold green]✓[/]" if report["ok"] else "[bold red]✗[/]"
    console.print(
        f"{mark} naive dual write lost {naive['lost']} of {naive['committed']} events;"
        f" outbox lost {outbox['lost']} of {outbox['committed']}",
        highlight=False,
    )
    if outbox["duplicates_absorbed"]:
        console.print(
            f"  duplicates: {outbox['duplicates_dropped_by_broker']} re-published after the"
            " killed relay's lease expired (dropped by the broker's Nats-Msg-Id dedup),"
            f" {outbox['duplicates_dropped_by_consumer']} redelivered (dropped by the consumer)",
            highlight=False,
        )
    console.print(
        "  outbox p99 includes the events that waited out the outage; the naive path has"
        " no such tail because it lost them",
        style="dim",
        highlight=False,
    )
    if outbox["dead_lettered"]:
        console.print(f"[red]  {outbox['dead_lettered']} event(s) dead-lettered[/]")
    for name, code in report["relay_exit_codes"].items():
        if name != VICTIM and code != 0:
            console.print(f"[red]  {name} exited with {code} on SIGTERM (expected 0)[/]")
    console.print(
        f"  runtime {report['runtime_s']:.1f}s (server start-up {report['server_start_s']:.1f}s)",
        style="dim",
        highlight=False,
    )
    if "relay_logs" in report:
        console.print(f"  relay logs: {report['relay_logs']}", markup=False, highlight=False)


def run_demo(
    *,
    orders: int = 1500,
    duration: float = 30.0,
    broker: str | None = None,
    dsn: str | None = None,
    as_json: bool = False,
) -> bool:
    """Run the demo, print its table (or one JSON object); True iff the outbox lost nothing.

    The naive path losing events is the point being shown, not a failure.
    """
    if orders < 10:
        raise ValueError("--orders must be at least 10")
    if broker is not None:
        _proxy_target(broker)
    if not 5.0 <= duration <= 3600.0:
        raise ValueError("--duration must be between 5 and 3600 seconds")
    out = Console()
    # With --json, stdout carries only the JSON object; progress goes to stderr.
    progress = Console(stderr=True) if as_json else out
    demo = _Demo(orders=orders, duration=duration, progress=progress)
    try:
        with _quiet_client_logs():
            report = demo.run(broker, dsn)
    except (KeyboardInterrupt, asyncio.CancelledError):
        progress.print(
            "[yellow]interrupted[/]: servers and relays stopped, temporary files removed"
        )
        return False
    if as_json:
        click.echo(json.dumps(report))
    else:
        _print_table(out, report)
    return bool(report["ok"])


@contextlib.contextmanager
def _quiet_client_logs() -> Iterator[None]:
    """nats-py and asyncio log every reconnect at ERROR; in this demo they are expected."""
    loggers = [logging.getLogger(n) for n in ("nats", "nats.aio.client", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
