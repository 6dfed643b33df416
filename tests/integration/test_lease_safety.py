"""Lease safety, behaviourally, against a real webhook receiver and real relays.

* the lease heartbeat: a publish that legitimately takes longer than the lease keeps
  its rows (no second relay re-claims them), bounded only by ``publish_timeout``;
* the fence: a relay that lost its lease while its publish hung settles late, and
  that settle changes nothing (``lease_lost`` logged and counted): the row keeps the
  outcome the relay that re-claimed it wrote;
* the backoff: every failed row's next ``available_at`` lies within
  ``[now, now + min(cap, base * 2^(attempt-1))]`` of its settle, read with the database clock;
* the crash loop: an event that SIGKILLs the relay each time it is published ends
  dead-lettered after ``max_attempts`` claims, never published again, while the
  other events flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit import Event
from outboxkit.ops.metrics import RelayMetrics
from outboxkit.publishers.webhook import WebhookPublisher
from outboxkit.sink.observer import RelayObserver
from outboxkit.testing import TcpProxy, free_port, spawn_relay
from tests.support.relaying import rows, running_relay, wait_for, write_events

REPO = Path(__file__).resolve().parents[2]

# -- a real receiver whose answer to each request a test scripts --------------------------

Action = Callable[[str, int], int | None]  # (event id, n-th request for it) -> status, None: drop


@dataclass
class _Hit:
    event_id: str
    at: float  # time.monotonic()


@dataclass
class ScriptedReceiver:
    """A threaded HTTP receiver; ``action(event_id, n)`` decides each answer (may block)."""

    action: Action = lambda _eid, _n: 204
    port: int = field(default_factory=free_port)
    hits: list[_Hit] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: http.server.ThreadingHTTPServer | None = None

    def url(self, **options: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"timeout": "30", **options}.items())
        return f"http://127.0.0.1:{self.port}/hooks?{query}"

    def count(self, event_id: str) -> int:
        with self._lock:
            return sum(h.event_id == event_id for h in self.hits)

    def start(self) -> None:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                event_id = self.headers.get("webhook-id", "")
                with owner._lock:
                    owner.hits.append(_Hit(event_id, time.monotonic()))
                    nth = sum(h.event_id == event_id for h in owner.hits)
                status = owner.action(event_id, nth)
                if status is None:
                    self.close_connection = True
                    return
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        server.handle_error = lambda *_a: None  # type: ignore[method-assign]
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@pytest.fixture
def receiver() -> Iterator[ScriptedReceiver]:
    hooks = ScriptedReceiver()
    hooks.start()
    yield hooks
    hooks.stop()


def _event(n: int, topic: str = "orders") -> Event:
    return Event(topic=topic, event_type="order.placed", key=f"k{n}", payload={"n": n})


def _db_now(dsn: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        assert row is not None
        return float(row[0])


def _lease_expiry(dsn: str, row_id: int) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM available_at)::float8 FROM outbox WHERE id = %s", (row_id,)
        ).fetchone()
        assert row is not None
        return float(row[0])


class _LostLeases(RelayObserver):
    def __init__(self) -> None:
        self.lost = 0

    def lost_leases(self, count: int) -> None:
        self.lost += count


# -- the heartbeat ---------------------------------------------------------------------------


async def test_a_publish_longer_than_the_lease_keeps_its_rows_while_it_runs(
    db_dsn: str, receiver: ScriptedReceiver
) -> None:
    """Lease 1.5 s, a webhook answering after 4.5 s, a second relay waiting: nobody re-claims."""
    hold = 4.5
    receiver.action = lambda _eid, _n: (time.sleep(hold), 204)[1]
    event = _event(1)
    write_events(db_dsn, [event])
    (row,) = rows(db_dsn)
    publisher = WebhookPublisher.from_url(receiver.url())
    options: dict[str, Any] = {"lease": 1.5, "publish_timeout": 10.0, "retention": "keep"}
    async with running_relay(db_dsn, publisher, relay_id="slow", **options) as slow:
        await wait_for(lambda: receiver.count(str(event.event_id)) == 1, what="the publish")
        started = _db_now(db_dsn)
        other = WebhookPublisher.from_url(receiver.url())
        async with running_relay(db_dsn, other, relay_id="other", **options) as rival:
            # Past the claim's own lease: the heartbeat has moved the expiry on.
            await asyncio.sleep(2.5)
            assert _lease_expiry(db_dsn, row["id"]) > started + 2.0
            await wait_for(lambda: slow.stats.published == 1, timeout=10, what="the settle")
            assert rival.stats.claimed == 0
    (done,) = rows(db_dsn)
    assert (done["status"], done["claimed_by"], done["attempts"]) == (1, "slow", 1)
    assert receiver.count(str(event.event_id)) == 1
    assert slow.stats.lease_lost == 0


async def test_publish_timeout_still_bounds_a_publish_the_heartbeat_extends(
    db_dsn: str, receiver: ScriptedReceiver
) -> None:
    """A receiver that never answers: the publish is cut at publish_timeout (> lease), retried."""
    stuck = threading.Event()
    receiver.action = lambda _eid, n: (stuck.wait(30), 204)[1] if n == 1 else 204
    write_events(db_dsn, [_event(1)])
    publisher = WebhookPublisher.from_url(receiver.url())
    options: dict[str, Any] = {"lease": 0.6, "publish_timeout": 2.0, "retention": "keep"}
    try:
        async with running_relay(db_dsn, publisher, retry_base=0.05, **options) as relay:
            began = time.monotonic()
            await wait_for(lambda: relay.stats.published == 1, timeout=15, what="the retry")
            took = time.monotonic() - began
    finally:
        stuck.set()
    (done,) = rows(db_dsn)
    assert done["attempts"] == 2
    assert "publish not confirmed within 2.0s" in (relay.stats.last_error or "")
    assert 1.9 < took < 8, took


# -- the fence -------------------------------------------------------------------------------


async def test_a_late_settle_after_the_lease_was_lost_changes_nothing(
    db_dsn: str, receiver: ScriptedReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    """Relay A hangs in its publish while cut off from the database (no heartbeat gets
    through); its lease expires, B re-claims and publishes. Then A's publish ends with a
    503 and A settles: a no-op, ``lease_lost`` logged and counted; the row stays B's."""
    release_a = threading.Event()

    def action(_eid: str, n: int) -> int:
        if n == 1:  # A's request: held, then refused (A's settle would mark a retry)
            release_a.wait(30)
            return 503
        return 204  # B's

    receiver.action = action
    event = _event(7)
    write_events(db_dsn, [event])
    (row,) = rows(db_dsn)
    host, port = _host_port(db_dsn)
    proxy = TcpProxy(host, port).start()
    lost = _LostLeases()
    metrics = RelayMetrics(db_dsn, registry=_registry(), process_metrics=False)
    caplog.set_level(logging.WARNING, logger="outboxkit.relay")
    options: dict[str, Any] = {"lease": 1.0, "publish_timeout": 30.0, "retention": "keep"}
    try:
        a_dsn = _through(db_dsn, proxy.port)
        from outboxkit.sink.observer import Observers

        a_pub = WebhookPublisher.from_url(receiver.url())
        async with running_relay(
            a_dsn, a_pub, relay_id="relay-a", observer=Observers(lost, metrics), **options
        ) as relay_a:
            await wait_for(lambda: receiver.count(str(event.event_id)) == 1, what="A's publish")
            proxy.pause()  # A's heartbeats (and everything else of A) now hang
            b_pub = WebhookPublisher.from_url(receiver.url())
            async with running_relay(db_dsn, b_pub, relay_id="relay-b", **options) as relay_b:
                await wait_for(
                    lambda: relay_b.stats.published == 1, timeout=15, what="B's re-claim"
                )
            (by_b,) = rows(db_dsn)
            assert (by_b["status"], by_b["claimed_by"]) == (1, "relay-b")
            proxy.resume()
            release_a.set()
            await wait_for(lambda: relay_a.stats.lease_lost == 1, timeout=15, what="A's settle")
        (final,) = rows(db_dsn)
    finally:
        release_a.set()
        proxy.close()
    # B's outcome, untouched by A's late "retry" settle.
    assert final["id"] == row["id"]
    assert (final["status"], final["claimed_by"], final["last_error"]) == (1, "relay-b", None)
    assert final["published_at"] is not None and final["attempts"] == 2
    assert relay_a.stats.retried == 0 and relay_a.stats.published == 0
    assert lost.lost == 1
    assert metrics.lease_lost_total._value.get() == 1
    assert any("lease_lost: 1 of 1 row(s)" in r.getMessage() for r in caplog.records)
    assert receiver.count(str(event.event_id)) == 2


def _registry() -> Any:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


def _host_port(dsn: str) -> tuple[str, int]:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    return str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432)


def _through(dsn: str, port: int) -> str:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info.update(host="127.0.0.1", port=str(port))
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items() if v is not None})


# -- the backoff -----------------------------------------------------------------------------

_SETTLE_LOG = """
CREATE TABLE settle_log (id bigint, attempts int, status smallint, now_at timestamptz,
                         available_at timestamptz);
CREATE FUNCTION log_settle() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- a settle of a failure: the claim token goes, last_error comes
    IF OLD.claim_token IS NOT NULL AND NEW.claim_token IS NULL AND NEW.last_error IS NOT NULL THEN
        INSERT INTO settle_log VALUES (NEW.id, NEW.attempts, NEW.status, now(), NEW.available_at);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER log_settle AFTER UPDATE ON outbox FOR EACH ROW EXECUTE FUNCTION log_settle();
"""


async def test_a_failed_row_waits_within_the_full_jitter_bound_of_its_attempt(
    db_dsn: str, receiver: ScriptedReceiver
) -> None:
    """Every settle of a failure, read by a trigger with the settle's own now():
    now <= available_at <= now + min(cap, base * 2^(attempt-1)), over several attempts."""
    base, cap, attempts, n_rows = 0.15, 0.6, 5, 20
    receiver.action = lambda _eid, _n: 503
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(_SETTLE_LOG)
    write_events(db_dsn, [_event(i) for i in range(n_rows)])
    publisher = WebhookPublisher.from_url(receiver.url())
    options: dict[str, Any] = {
        "retry_base": base,
        "retry_cap": cap,
        "max_attempts": attempts,
        "poll_interval": 0.05,
    }
    async with running_relay(db_dsn, publisher, **options) as relay:
        await wait_for(lambda: relay.stats.dead_lettered == n_rows, timeout=30, what="dead")
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        log = conn.execute(
            "SELECT attempts, status, extract(epoch FROM available_at - now_at)::float8"
            " FROM settle_log ORDER BY attempts"
        ).fetchall()
    retries = [(a, delay) for a, status, delay in log if status == 0]
    assert len(retries) == n_rows * (attempts - 1)
    for attempt, delay in retries:
        bound = min(cap, base * 2 ** (attempt - 1))
        assert 0.0 <= delay <= bound + 1e-6, (attempt, delay, bound)
    # The bound grows with the attempt, and the delays use it: not all stuck near zero.
    by_attempt = {a: [d for x, d in retries if x == a] for a in range(1, attempts)}
    assert max(by_attempt[1]) <= base
    assert max(by_attempt[attempts - 1]) > 2 * base
    # The last attempt is dead-lettered at once, with no wait.
    dead = [delay for _a, status, delay in log if status == 2]
    assert len(dead) == n_rows and all(abs(d) < 1e-6 for d in dead)


# -- the crash loop --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_an_event_that_kills_the_relay_is_dead_lettered_after_max_attempts_claims(
    db_dsn: str, receiver: ScriptedReceiver, tmp_path: Path, ordered: bool
) -> None:
    """The receiver SIGKILLs the relay process whenever the poison event reaches it.

    Without a claim-side guard the poison is re-claimed forever (attempts are counted at
    claim, dead-lettering happened only at settle); with it, the claim after the
    ``max_attempts``-th dead-letters it unread and it never reaches the receiver again.
    """
    max_attempts = 3
    events = [_event(i) for i in range(30)]
    poison = events[10]
    relay: list[subprocess.Popen[bytes]] = []
    kills = 0

    def action(event_id: str, _n: int) -> int | None:
        nonlocal kills
        if event_id == str(poison.event_id):
            kills += 1
            os.kill(relay[-1].pid, signal.SIGKILL)
            return None
        return 204

    receiver.action = action
    mode: tuple[str, ...] = ()
    if ordered:
        from outboxkit.backends.postgres.migrate import migrate

        migrate(db_dsn, table="outbox", ordered=True, partitions=4)
        mode = ("--ordered", "--on-dead-letter", "block")
    write_events(db_dsn, events)
    log_path = tmp_path / "relay.log"

    def spawn() -> None:
        relay.append(
            spawn_relay(
                db_dsn,
                receiver.url(),
                log_path,
                *("--lease", "1", "--max-attempts", str(max_attempts)),
                *("--batch-size", "1", "--max-in-flight", "1", "--poll-interval", "0.1"),
                *("--retry-base", "0.05", "--retention", "keep", "--log-interval", "60"),
                *mode,
                log_level="info",
                cwd=REPO,
            )
        )

    healthy = {str(e.event_id) for e in events} - {str(poison.event_id)}
    spawn()
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            if relay[-1].poll() is not None:
                assert relay[-1].returncode == -signal.SIGKILL, log_path.read_text()
                spawn()
            state = {str(r["event_id"]): r["status"] for r in rows(db_dsn)}
            if state[str(poison.event_id)] == 2 and all(state[e] == 1 for e in healthy):
                break
            time.sleep(0.1)
        # One more lease (and poll) after the end: the poison must not come back.
        time.sleep(2.5)
        assert relay[-1].poll() is None, "the relay was killed again: the poison was re-published"
    finally:
        for proc in relay:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(15)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    by_id = {str(r["event_id"]): r for r in rows(db_dsn)}
    dead = by_id[str(poison.event_id)]
    assert dead["status"] == 2, (dead, log_path.read_text()[-3000:])
    assert receiver.count(str(poison.event_id)) == max_attempts == kills
    assert dead["attempts"] >= max_attempts and dead["last_error"]
    assert all(by_id[e]["status"] == 1 for e in healthy)
    assert all(receiver.count(e) >= 1 for e in healthy)
    print(f"poison dead-lettered: {dead['last_error']!r}")
