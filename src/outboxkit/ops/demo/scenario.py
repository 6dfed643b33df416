"""What happens in `outboxkit demo`: the servers, two write paths, the faults, the consumer.

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
import logging
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql
from rich.console import Console

from outboxkit._redact import redact
from outboxkit.backends.postgres._connection import aconnect
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.postgres import Statements, Status
from outboxkit.cdc import slots as cdc_slots
from outboxkit.errors import OutboxkitError
from outboxkit.events import Event
from outboxkit.ops.demo.display import Display
from outboxkit.ops.demo.report import VICTIM, PathStats, build_report
from outboxkit.ops.demo.servers import (
    attr,
    close_nats,
    create_scratch_database,
    delete_stream,
    drop_scratch_database,
    embedded_servers,
    nats_connect,
    proxy_for,
    quietly,
    signal_process,
    start_servers,
    wait_exit,
)
from outboxkit.testing import TcpProxy, spawn_relay
from outboxkit.write import Outbox

log = logging.getLogger("outboxkit.demo")

TABLE = "outbox"
RELAYS = ("relay-a", "relay-b")
#: The demo's own connections (the writers and the monitor) in pg_stat_activity.
APPLICATION_NAME = "outboxkit-demo"
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
WHERE claimed_by = %s AND claim_token IS NOT NULL AND status = {pending} AND available_at > now()
"""
STILL_PENDING = "SELECT count(*) FROM {table} WHERE event_id = ANY(%s) AND status = {pending}"
RELAYS_CONNECTED = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'outboxkit-relay:claim'
"""


class Scenario:
    """Runs the two write paths, the faults, the consumer; the display shows it as it goes."""

    def __init__(
        self, *, orders: int, duration: float, progress: Console, source: str = "poll"
    ) -> None:
        self.orders = orders
        # cdc: the relays stream the outbox's replication slot; relay-a streams, relay-b
        # waits as its standby and takes over when relay-a is SIGKILLed.
        self.source = source
        self._logs = Path()
        self.duration = duration
        self.naive = PathStats()
        self.outbox = PathStats()
        self.backlog = 0
        self.display = Display(
            progress,
            orders=orders,
            duration=duration,
            naive=self.naive,
            outbox=self.outbox,
            backlog=lambda: self.backlog,
        )
        self.dead_letters = 0
        self.relays: dict[str, subprocess.Popen[bytes]] = {}
        self.relay_codes: dict[str, int | None] = {}
        self.kill: dict[str, Any] = {}
        self.server_start_s = 0.0
        self.started = time.monotonic()
        self._rng = random.Random()
        self._outbox_writer = Outbox(TABLE)
        self._naive_tasks: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._naive_js: Any = None
        self.outbox_subject = self.naive_subject = ""
        self._sql = Statements(TABLE)
        slots = {"table": self._sql.qualified, "pending": int(Status.PENDING)}
        self._held_by = sql.SQL(HELD_BY_RELAY.format(**slots))
        self._still_pending = sql.SQL(STILL_PENDING.format(**slots))

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
                pg, nats_server = embedded_servers(
                    work, want_pg=dsn is None, want_nats=broker is None, logical=self.cdc
                )
                for server in (pg, nats_server):
                    if server is not None:  # close() also deletes PostgreSQL's data directory
                        stack.callback(quietly, server.close)
                started = time.monotonic()
                start_servers(pg, nats_server, self.display.say)
                self.server_start_s = time.monotonic() - started
                server_dsn = dsn if dsn is not None else str(attr(pg, "dsn"))
                broker_url = broker if broker is not None else str(attr(nats_server, "url"))
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

    async def _main(
        self, server_dsn: str, broker_url: str, nats_server: Any, logs: Path
    ) -> dict[str, Any]:
        from nats.js.api import ConsumerConfig, StorageType

        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()
        assert main_task is not None
        loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
        async with contextlib.AsyncExitStack() as stack:
            db_name, dsn = await create_scratch_database(server_dsn)
            stack.push_async_callback(drop_scratch_database, server_dsn, db_name)
            await asyncio.to_thread(migrate, dsn, table=TABLE)
            if self.cdc:  # the slot goes before the database (DROP DATABASE refuses a slot)
                await asyncio.to_thread(cdc_slots.setup, dsn, table=TABLE)
                stack.push_async_callback(asyncio.to_thread, quietly, lambda: _drop_slot(dsn))
            async with await aconnect(dsn, application_name=APPLICATION_NAME) as conn:
                await conn.execute(CREATE_ORDERS)

            # A broker the user runs cannot be stopped by us: cut a proxy in front of it.
            proxy: TcpProxy | None = None
            client_url = broker_url
            if nats_server is None:
                proxy, client_url = proxy_for(broker_url)
                stack.callback(proxy.close)
            suffix = "" if nats_server is not None else "_" + secrets.token_hex(3)
            stream, prefix = f"DEMO{suffix.upper()}", f"demo{suffix}"
            self.outbox_subject = f"{prefix}.outbox.order.placed"
            self.naive_subject = f"{prefix}.naive.order.placed"
            subjects = [f"{prefix}.outbox.>", f"{prefix}.naive.>"]

            admin = await nats_connect(client_url, "outboxkit-demo-admin")
            stack.push_async_callback(close_nats, admin)
            js_admin = admin.jetstream()
            await js_admin.add_stream(
                name=stream,
                subjects=subjects,
                storage=StorageType.FILE,
                duplicate_window=DUPLICATE_WINDOW_S,
                max_age=3600.0,
            )
            if nats_server is None:
                stack.push_async_callback(delete_stream, js_admin, stream)

            consumer = await nats_connect(client_url, "outboxkit-demo-consumer")
            stack.push_async_callback(close_nats, consumer)
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
            naive_nc = await nats_connect(client_url, "outboxkit-demo-naive", pending_size=0)
            stack.push_async_callback(close_nats, naive_nc)
            self._naive_js = naive_nc.jetstream()

            relay_broker = (
                f"{client_url.split('?')[0]}?stream={stream}&subjects={','.join(subjects)}"
            )
            stack.push_async_callback(self._reap_relays)
            self._logs = logs
            for name in RELAYS:
                self.relays[name] = spawn_relay(
                    dsn,
                    relay_broker,
                    logs / f"{name}.log",
                    "--relay-id",
                    name,
                    *RELAY_OPTIONS,
                    *(("--source", "cdc") if self.cdc else ()),
                    log_level=None,
                )
                if self.cdc and name == RELAYS[0]:  # relay-a streams, relay-b is its standby
                    await self._wait_for_log(name, "streaming slot")

            self._outbox_conn = await aconnect(dsn, application_name=APPLICATION_NAME)
            stack.push_async_callback(self._outbox_conn.close)
            self._naive_conn = await aconnect(dsn, application_name=APPLICATION_NAME)
            stack.push_async_callback(self._naive_conn.close)
            self._monitor_conn = await aconnect(dsn, application_name=APPLICATION_NAME)
            stack.push_async_callback(self._monitor_conn.close)
            await self._wait_for_relays(logs)

            async with self.display.showing():
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

    @property
    def cdc(self) -> bool:
        return self.source == "cdc"

    def _logged(self, name: str, text: str) -> bool:
        with contextlib.suppress(OSError):
            return text in (self._logs / f"{name}.log").read_text(errors="replace")
        return False

    async def _wait_for_log(self, name: str, text: str, within: float = 30.0) -> None:
        """Wait for ``text`` in relay ``name``'s log (cdc: streaming, or waiting as standby)."""
        deadline = time.monotonic() + within
        while not self._logged(name, text):
            proc = self.relays[name]
            if proc.poll() is not None:
                raise OutboxkitError(
                    f"{name} exited with code {proc.returncode} at start-up;"
                    f" see its log in {self._logs}"
                )
            if time.monotonic() > deadline:
                raise OutboxkitError(f"{name} did not log {text!r} within {within:.0f}s")
            await asyncio.sleep(0.1)

    async def _wait_for_relays(self, logs: Path) -> None:
        """Start the clock only once both relays have connected, so latencies are fair."""
        if self.cdc:
            await self._wait_for_log(RELAYS[1], "standby:")
            return
        deadline = time.monotonic() + 20.0
        while True:
            cur = await self._monitor_conn.execute(RELAYS_CONNECTED)
            row = await cur.fetchone()
            if row is not None and row[0] >= len(RELAYS):
                return
            for name, proc in self.relays.items():
                if proc.poll() is not None:
                    raise OutboxkitError(
                        f"{name} exited with code {proc.returncode} at start-up;"
                        f" see its log in {logs}"
                    )
            if time.monotonic() > deadline:
                raise OutboxkitError(f"relays did not connect within 20s; see their logs in {logs}")
            await asyncio.sleep(0.1)

    # -- the scenario ----------------------------------------------------------------

    async def _scenario(self, nats_server: Any, proxy: TcpProxy | None) -> None:
        self.display.t0 = time.monotonic()
        rate = self.orders / self.duration
        self.display.note(
            f"placing {rate:.0f} orders/s through each path; relay-a and relay-b running",
            phase="steady",
        )
        orders = asyncio.gather(self._place_orders("naive"), self._place_orders("outbox"))
        faults = asyncio.ensure_future(self._faults(nats_server, proxy))
        try:
            await orders
            self.display.note(
                "all orders placed; waiting for the outbox to drain", phase="draining"
            )
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

    async def _faults(self, nats_server: Any, proxy: TcpProxy | None) -> None:
        await self._sleep_until(BROKER_DOWN_AT)
        if proxy is not None:
            await asyncio.to_thread(proxy.cut)
            what = "connections to your broker cut at the proxy"
        else:
            await asyncio.to_thread(nats_server.stop)
            what = "nats-server stopped"
        self.display.note(
            f"broker DOWN ({what}): naive publishes fail, the outbox keeps the events",
            phase="broker down",
        )
        await self._sleep_until(BROKER_UP_AT)
        if proxy is not None:
            await asyncio.to_thread(proxy.resume)
        else:
            await asyncio.to_thread(nats_server.start)
        self.display.note("broker back: relays publish the backlog", phase="broker back")
        await self._sleep_until(RELAY_KILL_AT)
        await self._kill_mid_batch(VICTIM)

    async def _sleep_until(self, fraction: float) -> None:
        await asyncio.sleep(max(0.0, self.display.t0 + fraction * self.duration - time.monotonic()))

    async def _kill_mid_batch(self, name: str) -> None:
        """SIGKILL ``name`` while it holds a claim: freeze it, check, then kill.

        SIGSTOP first, because a batch is claimed, published and settled within
        milliseconds: a kill sent on sight could land after the settle.
        """
        if self.cdc:
            await self._kill_streaming(name)
            return
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
        await asyncio.to_thread(proc.wait)
        killed_at = self.display.elapsed()
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
            self.display.note(
                f"{name} SIGKILLed mid-batch holding {len(held)} claimed event(s),"
                f" {published} already published but not settled; relay-b carries on",
                phase=f"{name} killed",
            )
            self._watcher = asyncio.create_task(self._watch_takeover(held, killed_at))
        else:
            self.display.note(
                f"{name} SIGKILLed (it held no claim within 5s); relay-b carries on",
                phase=f"{name} killed",
            )

    async def _kill_streaming(self, name: str) -> None:
        """cdc: SIGKILL the relay streaming the slot; its standby takes the slot over."""
        proc = self.relays[name]
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
        killed_at = self.display.elapsed()
        self.kill = {"relay": name, "at_s": round(killed_at, 2), "held_events": 0}
        self.display.note(
            f"{name} SIGKILLed while streaming the slot: what it published but had not"
            " confirmed comes again (NATS drops the duplicates); relay-b takes over",
            phase=f"{name} killed",
        )
        self._watcher = asyncio.create_task(self._watch_slot_takeover(killed_at))

    async def _watch_slot_takeover(self, killed_at: float) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._logged(RELAYS[1], "streaming slot"):
                after = self.display.elapsed() - killed_at
                self.kill["taken_over_after_s"] = round(after, 2)
                self.display.note(
                    f"relay-b took over the slot {after:.1f}s after the kill and streams on"
                )
                return
            await asyncio.sleep(0.1)

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
                    after = self.display.elapsed() - killed_at
                    self.kill["taken_over_after_s"] = round(after, 2)
                    self.display.note(
                        f"relay-b re-claimed {VICTIM}'s {len(held)} event(s) when the lease"
                        f" expired and published them ({after:.1f}s after the kill)"
                    )
                    return
            await asyncio.sleep(0.1)

    async def _place_orders(self, path: str) -> None:
        interval = self.duration / self.orders
        for i in range(self.orders):
            delay = self.display.t0 + i * interval - time.monotonic()
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
                self.display.note("outbox drained; every event the broker accepted has arrived")
                return
            await asyncio.sleep(0.1)
        self.display.note(
            f"gave up waiting after {DRAIN_TIMEOUT_S:.0f}s (outbox backlog {self.backlog})"
        )

    # -- relays ------------------------------------------------------------------------

    async def _stop_relays(self) -> None:
        """SIGTERM the survivors: a relay finishes its batch, hands back the rest, exits 0."""
        self.display.phase = "stopping relays"
        for proc in self.relays.values():
            signal_process(proc, signal.SIGTERM)
        for name, proc in self.relays.items():
            self.relay_codes[name] = await wait_exit(proc, 15.0)

    async def _reap_relays(self) -> None:
        for proc in self.relays.values():
            signal_process(proc, signal.SIGTERM)
        for proc in self.relays.values():
            if await wait_exit(proc, 5.0) is None:
                signal_process(proc, signal.SIGKILL)
                await wait_exit(proc, 5.0)

    # -- the result ----------------------------------------------------------------------

    async def _report(self, broker_url: str, *, external: bool) -> dict[str, Any]:
        committed: dict[str, set[int]] = {"naive": set(), "outbox": set()}
        cur = await self._monitor_conn.execute(ORDERS_BY_PATH)
        for path, order_id in await cur.fetchall():
            committed[path].add(order_id)
        cur = await self._monitor_conn.execute(self._sql.status_by_topic)
        rows = await cur.fetchall()
        self.dead_letters = sum(r[3] for r in rows)
        return build_report(
            naive=self.naive,
            outbox=self.outbox,
            committed=committed,
            dead_letters=self.dead_letters,
            kill=self.kill,
            relay_codes=self.relay_codes,
            relays=RELAYS,
            notes=self.display.notes,
            orders=self.orders,
            duration=self.duration,
            runtime_s=time.monotonic() - self.started,
            server_start_s=self.server_start_s,
            broker=redact(broker_url) if external else "embedded NATS JetStream",
        )


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


def _drop_slot(dsn: str) -> None:
    cdc_slots.drop(dsn, table=TABLE, force=True)
