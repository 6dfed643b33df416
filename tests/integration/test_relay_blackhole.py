"""A claim or settle connection whose network path turns into a black hole (a failover, a NAT
or firewall that dropped its state: nothing answers, nothing fails) is hung up within a share
of the lease (backends/postgres/_pg_session.py, ``ANSWER_SHARE``) and the relay goes on over a new
one. The proxy holds every byte of the relay's old connections and forwards new ones. The lease is 3
s here, so the bound is 1 s and the tests take seconds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outboxkit import Event, OutboundMessage, PublishResult
from outboxkit.backends.postgres import _pg_session
from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.queue_pg import PgQueueStore
from outboxkit.tasks import Tasks, Worker
from outboxkit.testing import TcpProxy
from tests.support.relaying import TimingPublisher, count, make_events, running_relay, write_events

LEASE = 3.0
HUNG_UP = "did not answer"
#: Bound (1 s) + backoff + a claim: generous for a loaded machine, well below the lease.
RECOVERED = 4.0

pytestmark = pytest.mark.exclusive  # the naive test's window and the bound are timings


def _proxied(proxy_factory: Callable[..., TcpProxy], dsn: str) -> tuple[str, TcpProxy]:
    params = conninfo_to_dict(dsn)
    host = str(params.get("host") or "127.0.0.1")
    proxy = proxy_factory("127.0.0.1" if host == "localhost" else host, int(params["port"]))
    return make_conninfo(dsn, host="127.0.0.1", port=proxy.port), proxy


def _ports(dsn: str, *roles: str) -> list[int]:
    """The client ports (the proxy's upstream side) of the relay's connections of ``roles``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = ANY(%s)",
            ([f"outboxkit-relay:{r}" for r in roles],),
        ).fetchall()
    return [int(r[0]) for r in rows]


def _hung_up_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if HUNG_UP in r.getMessage() and r.levelno >= logging.INFO]


async def _published(publisher: TimingPublisher, ids: set[object], within: float) -> bool:
    deadline = time.monotonic() + within
    while not ids <= publisher.at.keys():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.fixture(autouse=True)
def _settles_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every settle on the settle connection, these tests' subject: a claim carrying the
    last claim's settle (queue/carry.py) would leave that connection unused."""
    monkeypatch.setattr(PgQueueStore, "carries_settles", property(lambda self: False))


@contextlib.asynccontextmanager
async def _relay(db_dsn: str, dsn: str, publisher: TimingPublisher) -> AsyncIterator[None]:
    """The relay on ``dsn`` (the proxy), once one event was claimed, published and settled:
    both its connections are open."""
    async with running_relay(dsn, publisher, lease=LEASE, poll_interval=0.2):
        first = make_events("t", 1)
        await asyncio.to_thread(write_events, db_dsn, first)
        assert await _published(publisher, {first[0].event_id}, 10.0)
        deadline = time.monotonic() + 10
        while len(await asyncio.to_thread(_ports, db_dsn, "claim", "settle")) < 2:
            assert time.monotonic() < deadline, "the relay opened no settle connection"
            await asyncio.sleep(0.02)
        yield


async def _black_holed_then_written(db_dsn: str, proxy: TcpProxy) -> list[Event]:
    """Hold the relay's claim and settle connections in the proxy, then commit 20 events."""
    for port in await asyncio.to_thread(_ports, db_dsn, "claim", "settle"):
        proxy.hold(port)
    events = make_events("t", 20)
    await asyncio.to_thread(write_events, db_dsn, events)
    return events


async def test_black_holed_claim_and_settle_connections_are_hung_up_and_replaced(
    db_dsn: str, proxy_factory: Callable[..., TcpProxy], caplog: pytest.LogCaptureFixture
) -> None:
    dsn, proxy = _proxied(proxy_factory, db_dsn)
    publisher = TimingPublisher()
    caplog.set_level(logging.INFO, logger="outboxkit.relay")
    async with _relay(db_dsn, dsn, publisher):
        events = await _black_holed_then_written(db_dsn, proxy)
        held = time.monotonic()
        assert await _published(publisher, {e.event_id for e in events}, RECOVERED)
        recovered = time.monotonic() - held
        deadline = time.monotonic() + 5
        while await asyncio.to_thread(count, db_dsn) > 0:  # settled over a new connection
            assert time.monotonic() < deadline, "the published events were never settled"
            await asyncio.sleep(0.02)
    assert recovered < RECOVERED, recovered
    lines = _hung_up_lines(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.WARNING and "within 1s" in lines[0].getMessage()


async def test_a_settle_black_holed_in_flight_is_retried_before_the_lease_runs_out(
    db_dsn: str, proxy_factory: Callable[..., TcpProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """The publisher black-holes the settle connection while it publishes: the settle goes
    into the hole. It is hung up after 1 s and retried on a new connection under the same
    claim token, before the lease (3 s) lets another claim take the rows: each event is
    published once and settled, no lease reported lost."""
    dsn, proxy = _proxied(proxy_factory, db_dsn)
    hole: list[int] = []
    published: list[object] = []  # every publication, repeats included

    class HoldingPublisher(TimingPublisher):
        async def publish_batch(self, messages: list[OutboundMessage]) -> list[PublishResult]:
            if hole:
                proxy.hold(hole.pop())
            published.extend(m.event_id for m in messages)
            return await super().publish_batch(messages)

    publisher = HoldingPublisher()
    caplog.set_level(logging.INFO, logger="outboxkit.relay")
    async with _relay(db_dsn, dsn, publisher):
        hole.extend(await asyncio.to_thread(_ports, db_dsn, "settle"))
        events = make_events("t", 20)
        await asyncio.to_thread(write_events, db_dsn, events)
        assert await _published(publisher, {e.event_id for e in events}, RECOVERED)
        deadline = time.monotonic() + RECOVERED
        while await asyncio.to_thread(count, db_dsn) > 0:
            assert time.monotonic() < deadline, "the hung settle was never retried"
            await asyncio.sleep(0.02)
    assert not hole, "the settle connection was never black-holed"
    assert len(published) == len(set(published)), "an event was published twice"
    lines = [r.getMessage() for r in _hung_up_lines(caplog)]
    assert len(lines) == 1 and "answer the settle within 1s" in lines[0], lines
    assert not any("lease_lost" in r.getMessage() for r in caplog.records)


async def test_without_the_deadline_a_black_holed_claim_connection_stops_the_relay_silently(
    db_dsn: str,
    proxy_factory: Callable[..., TcpProxy],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The naive relay (wait for every answer): it stops publishing, and says nothing."""
    monkeypatch.setattr(_pg_session, "ANSWER_SHARE", None)
    dsn, proxy = _proxied(proxy_factory, db_dsn)
    publisher = TimingPublisher()
    caplog.set_level(logging.INFO, logger="outboxkit.relay")
    async with _relay(db_dsn, dsn, publisher):
        events = await _black_holed_then_written(db_dsn, proxy)
        stuck = not await _published(publisher, {e.event_id for e in events}, RECOVERED)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        proxy.cut()  # (lets the hung statements fail, so that the relay can stop)
    assert stuck, "the naive relay published through a black-holed connection"
    assert not any(e.event_id in publisher.at for e in events)
    assert warnings == [], warnings


async def test_the_relays_connections_carry_tcp_keepalives_unless_the_dsn_sets_its_own(
    db_dsn: str,
) -> None:
    """Read back from the sockets themselves: libpq applied what the store asked for."""
    own = make_conninfo(db_dsn, host="127.0.0.1", keepalives_idle=7)
    store = PgQueueStore(own, "outbox", OutboundMessage)
    try:
        conn = await store._connection("claim")
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            options = (
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
            )
    finally:
        await store.close()
    assert options == (1, 7, 5, 30_000)


def test_the_bound_is_a_third_of_the_lease_and_never_under_a_second() -> None:
    store = PgQueueStore("postgresql://127.0.0.1/none", "outbox", OutboundMessage)
    bounds = []
    for lease in (_pg_session.DEFAULT_LEASE, 60.0, 3.0, 0.6):
        store.lease = lease
        bounds.append(store.answer_within)
    assert bounds == [10.0, 20.0, 1.0, 1.0]


def _task_rows(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outboxkit_tasks").fetchone()
    return int(row[0]) if row else 0


async def test_the_task_workers_black_holed_claim_and_settle_connections_are_replaced(
    db_dsn: str, proxy_factory: Callable[..., TcpProxy], caplog: pytest.LogCaptureFixture
) -> None:
    """The worker is the same claim loop on the same session code: its claim and settle
    connections held in the proxy are hung up within the bound, the tasks enqueued after
    the hold all start, and every one is completed over a new connection."""
    migrate_tasks(db_dsn)
    dsn, proxy = _proxied(proxy_factory, db_dsn)
    started: dict[int, float] = {}
    tasks = Tasks()
    tasks.handler("t")(lambda payload: started.setdefault(payload, time.monotonic()))

    def enqueue(numbers: range) -> None:
        with psycopg.connect(db_dsn) as conn, conn.transaction():
            for n in numbers:
                tasks.enqueue(conn, "t", n)

    caplog.set_level(logging.INFO)
    worker = Worker(tasks, dsn, lease=LEASE, poll_interval=0.2)
    running = asyncio.create_task(worker.run())
    try:
        await asyncio.to_thread(enqueue, range(1))
        deadline = time.monotonic() + 10
        while not (
            0 in started and len(await asyncio.to_thread(_worker_ports, db_dsn)) >= 2
        ):  # both connections open: a task claimed and completed
            assert time.monotonic() < deadline, "the worker never ran the first task"
            await asyncio.sleep(0.02)
        for port in await asyncio.to_thread(_worker_ports, db_dsn):
            proxy.hold(port)
        await asyncio.to_thread(enqueue, range(1, 21))
        held = time.monotonic()
        while not set(range(21)) <= started.keys() or await asyncio.to_thread(_task_rows, db_dsn):
            assert time.monotonic() - held < RECOVERED + 5, (
                f"started {sorted(started)}; rows left {_task_rows(db_dsn)}"
            )
            await asyncio.sleep(0.02)
    finally:
        worker.stop()
        await asyncio.wait_for(running, timeout=30)
    assert max(started.values()) - held < RECOVERED
    assert 1 <= len(_hung_up_lines(caplog)) <= 2, [r.getMessage() for r in _hung_up_lines(caplog)]


def _worker_ports(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = ANY(%s)",
            (["outboxkit-worker:claim", "outboxkit-worker:settle"],),
        ).fetchall()
    return [int(r[0]) for r in rows]
