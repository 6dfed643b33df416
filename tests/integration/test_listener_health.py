"""A LISTEN connection that dies silently is detected and replaced
(backends/postgres/_pg_session.py), for the relay and the task worker alike: its backend terminated,
or its network path turned into a black hole (a proxy that holds every byte without closing). The
poll is 30 s away, so only a working listener explains a start within milliseconds; the health probe
is made quick here (0.2 s, answer within 0.5 s) so that the tests take seconds."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable, Mapping
from typing import Any, Protocol

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outboxkit import Event, Outbox
from outboxkit.backends.postgres import _pg_session
from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.tasks import Tasks, Worker
from outboxkit.testing import TcpProxy
from tests.support.relaying import TimingPublisher, running_relay

#: A wake-up, not the poll (30 s): generous for a loaded machine, far below the poll.
WOKEN = 1.0
LOST = "LISTEN connection is lost"
BACK = "LISTEN connection is back"


class _App(Protocol):
    listener: str  # its LISTEN connection's application_name
    logger: str
    writer_dsn: str  # PostgreSQL itself (the app's own may go through a proxy)
    started: Mapping[Any, float]

    def submit(self) -> Hashable: ...

    def running(self) -> contextlib.AbstractAsyncContextManager[None]: ...


class _WorkerApp:
    listener = "outboxkit-worker:listen"
    logger = "outboxkit.worker"

    def __init__(self, dsn: str, writer_dsn: str) -> None:
        migrate_tasks(writer_dsn)
        self.dsn, self.writer_dsn = dsn, writer_dsn
        self.started: dict[Hashable, float] = {}
        self.tasks = Tasks()
        self.tasks.handler("t")(lambda payload: self.started.setdefault(payload, time.monotonic()))
        self._numbers = itertools.count()

    def submit(self) -> Hashable:
        n = next(self._numbers)
        with psycopg.connect(self.writer_dsn) as conn, conn.transaction():
            self.tasks.enqueue(conn, "t", n)
        return n

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        worker = Worker(self.tasks, self.dsn, poll_interval=30.0)
        task = asyncio.create_task(worker.run())
        try:
            yield
        finally:
            worker.stop()
            await asyncio.wait_for(task, timeout=30)


class _RelayApp:
    listener = "outboxkit-relay:listen"
    logger = "outboxkit.relay"

    def __init__(self, dsn: str, writer_dsn: str) -> None:
        self.dsn, self.writer_dsn = dsn, writer_dsn
        self.publisher = TimingPublisher()
        self.started = self.publisher.at

    def submit(self) -> Hashable:
        event = Event(topic="t", event_type="x", payload={"n": 1})
        with psycopg.connect(self.writer_dsn, autocommit=True) as conn:
            with Outbox().transaction(conn) as tx:
                tx.put(event)
        return event.event_id

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with running_relay(self.dsn, self.publisher, poll_interval=30.0):
            yield


APPS: dict[str, Callable[[str, str], _App]] = {"relay": _RelayApp, "worker": _WorkerApp}


@pytest.fixture(autouse=True)
def quick_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pg_session, "LISTEN_CHECK_INTERVAL", 0.2)
    monkeypatch.setattr(_pg_session, "LISTEN_CHECK_TIMEOUT", 0.5)


def _listening_port(dsn: str, app_name: str, other_than: int | None = None) -> int | None:
    """The client port of the newest backend of ``app_name`` that ran LISTEN (or a probe)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT client_port FROM pg_stat_activity WHERE application_name = %s"
            " AND datname = current_database() AND query <> '' AND client_port IS DISTINCT"
            " FROM %s ORDER BY backend_start DESC LIMIT 1",
            (app_name, other_than),
        ).fetchone()
    return None if row is None else int(row[0])


async def _listening(dsn: str, app_name: str, other_than: int | None = None) -> int:
    deadline = time.monotonic() + 10
    while (port := await asyncio.to_thread(_listening_port, dsn, app_name, other_than)) is None:
        assert time.monotonic() < deadline, f"no {app_name} connection listens"
        await asyncio.sleep(0.05)
    return port


def _gate_closed(dsn: str) -> bool:
    """Whether a session holds the wake-up gate's exclusive advisory lock in this database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND mode = 'ExclusiveLock'"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchone()
    return row is not None and row[0] > 0


async def _latency(app: _App, timeout: float = 5.0) -> float:
    """Seconds from a commit to its task's start (its event's publication); inf if none.

    Idle first: the loop, done lingering, holds its wake-up gate (and has claimed once more
    after taking it), so only a wake-up (or the poll, 30 s away) can start the next one.
    """
    await asyncio.sleep(0.1)  # (the gate was opened when the last one was claimed)
    deadline = time.monotonic() + 10
    while not await asyncio.to_thread(_gate_closed, app.writer_dsn):
        assert time.monotonic() < deadline, "the loop never went idle"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    key = await asyncio.to_thread(app.submit)
    committed = time.monotonic()
    while key not in app.started:
        if time.monotonic() - committed > timeout:
            return float("inf")
        await asyncio.sleep(0.002)
    return max(0.0, app.started[key] - committed)


async def _logged(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"never logged: {text!r}"
        await asyncio.sleep(0.01)


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def _proxied(proxy_factory: Callable[..., TcpProxy], dsn: str) -> tuple[str, TcpProxy]:
    """``dsn`` through a new proxy the test controls, and the proxy."""
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "127.0.0.1")
    proxy = proxy_factory("127.0.0.1" if host == "localhost" else host, int(params["port"]))
    return make_conninfo(dsn, host="127.0.0.1", port=proxy.port), proxy


def _terminate(dsn: str, port: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE client_port = %s AND datname = current_database()",
            (port,),
        )


@pytest.mark.parametrize("kind", APPS)
async def test_a_terminated_listener_is_replaced_and_wake_ups_come_within_milliseconds_again(
    kind: str, db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = APPS[kind](db_dsn, db_dsn)
    caplog.set_level(logging.INFO, logger=app.logger)
    async with app.running():
        first = await _listening(db_dsn, app.listener)
        assert await _latency(app) < WOKEN
        await asyncio.to_thread(_terminate, db_dsn, first)
        await _logged(caplog, BACK)
        await _listening(db_dsn, app.listener, other_than=first)
        after = [await _latency(app) for _ in range(2)]
    assert max(after) < WOKEN, after
    assert (_lines(caplog, LOST), _lines(caplog, BACK)) == (1, 1)


@pytest.mark.parametrize("kind", APPS)
async def test_a_black_holed_listener_is_detected_replaced_and_the_gap_is_covered(
    kind: str,
    db_dsn: str,
    proxy_factory: Callable[..., TcpProxy],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The proxy keeps the listener's connection open and forwards nothing: no error ever
    reaches it (nor TCP keepalives' failure: the proxy answers those). The probe's
    unanswered ``SELECT 1`` finds it; the replacement wakes the loop for what came meanwhile."""
    dsn, proxy = _proxied(proxy_factory, db_dsn)
    app = APPS[kind](dsn, db_dsn)
    caplog.set_level(logging.INFO, logger=app.logger)
    async with app.running():
        first = await _listening(db_dsn, app.listener)
        assert await _latency(app) < WOKEN
        proxy.hold(first)
        gap = await asyncio.to_thread(app.submit)  # committed while the listener is deaf
        held = time.monotonic()
        await _logged(caplog, BACK)
        replaced = time.monotonic() - held
        await _listening(db_dsn, app.listener, other_than=first)
        while gap not in app.started:
            assert time.monotonic() - held < 5.0, "the task committed in the gap never ran"
            await asyncio.sleep(0.01)
        after = [await _latency(app) for _ in range(2)]
    # Found by the probe (0.2 s + 0.5 s) and reconnected (backoff up to 0.5 s), not by the poll.
    assert replaced < 5.0, replaced
    assert max(after) < WOKEN, after
    assert (_lines(caplog, LOST), _lines(caplog, BACK)) == (1, 1)
    lost = next(r for r in caplog.records if LOST in r.getMessage())
    assert lost.levelno == logging.WARNING and "did not answer" in lost.getMessage()


async def test_without_the_probe_a_black_holed_listener_goes_unnoticed(
    db_dsn: str,
    proxy_factory: Callable[..., TcpProxy],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The naive listener (wait for notifications, nothing else): deaf, and nobody knows."""
    monkeypatch.setattr(_pg_session, "LISTEN_CHECK_INTERVAL", 3600.0)
    dsn, proxy = _proxied(proxy_factory, db_dsn)
    app = _WorkerApp(dsn, db_dsn)
    caplog.set_level(logging.INFO, logger=app.logger)
    async with app.running():
        first = await _listening(db_dsn, app.listener)
        assert await _latency(app) < WOKEN
        proxy.hold(first)
        assert await _latency(app, timeout=2.0) == float("inf"), "a deaf listener woke it"
    assert _lines(caplog, LOST) == 0
