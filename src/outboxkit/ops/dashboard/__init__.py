"""``outboxkit dashboard``: web pages to watch an outbox and a task table and act on them.

An aiohttp server with a small JSON API and two static pages (vanilla JS, inline
SVG charts, no build step): the outbox's (its dead letters) and task mode's (tasks.py).
Read-only unless started with an admin token; every action requires it in the
``X-Outboxkit-Token`` header, which a cross-site page cannot send (no CORS: the
browser's preflight fails), and is logged. The pages render every value with
``textContent``: payloads and errors are attacker-controlled text.

It also faces hostile clients: it answers only to the Host names it was given
(DNS rebinding), slows down token guessing, reuses a few database connections
instead of opening one per request, and lists at most ``max_topics`` topics.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import ipaddress
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from outboxkit._redact import mask_headers, redact, remember_secrets
from outboxkit.admin import Admin, admin_for
from outboxkit.backends.postgres.postgres import parse_table
from outboxkit.errors import ConfigurationError
from outboxkit.maintenance.report import LiveStatus, TopicStatus
from outboxkit.ops._throttle import Throttled
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE

log = logging.getLogger("outboxkit.dashboard")

STATIC = Path(__file__).parent / "static"
#: History kept for the charts.
HISTORY_SECONDS = 15 * 60
#: Payload bytes shown in the event view; the rest is cut (and said so).
MAX_PAYLOAD_CHARS = 64 * 1024
TOKEN_HEADER = "X-Outboxkit-Token"  # noqa: S105 - a header name, not a secret
#: Shortest admin token accepted: guessing must stay hopeless even at the allowed rate.
MIN_TOKEN_CHARS = 16
#: Wrong tokens a client may send per window before it is answered 429 until the window ends.
TOKEN_FAILURES_ALLOWED = 5
#: ... and all clients together (many addresses must not multiply the guessing rate).
TOKEN_FAILURES_ALLOWED_IN_ALL = 50
TOKEN_FAILURE_WINDOW = 60.0
#: Topics listed; the rest are summed in one row (a table with 100 000 topics stays readable).
DEFAULT_MAX_TOPICS = 100
OTHER_TOPICS = "(other)"
#: Database connections kept and used at once (requests beyond wait their turn).
POOL_SIZE = 2
#: Largest outbox row id (bigint): longer digit strings are refused before the database.
_MAX_ROW_ID = 2**63 - 1
_SECURITY_HEADERS = {
    # Only our own script and style; no inline script, so injected markup cannot run.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self';"
        " connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
_APP_KEY = web.AppKey("dashboard", object)
_T = TypeVar("_T")


class _RecentTopic:
    """One listed topic as the sampler last saw it, and the rows that left it since
    (``Dashboard._bounded_topics`` says how that is counted and what it misses)."""

    def __init__(self) -> None:
        self.last_seen = 0.0  # the last sample in which it had rows
        self.active: int | None = None  # pending + in flight at the previous sample
        self.failed = 0
        self.left: collections.deque[tuple[float, int]] = collections.deque()

    def observe(self, topic: TopicStatus | None, now: float) -> None:
        """Take one sample's reading of the topic (None: it had no rows)."""
        active = topic.pending + topic.in_flight if topic else 0
        failed = topic.failed if topic else 0
        if topic:
            self.last_seen = now
        if self.active is not None:
            left = self.active - active - max(0, failed - self.failed)
            if left > 0:
                self.left.append((now, left))
        self.active, self.failed = active, failed
        while self.left and now - self.left[0][0] > HISTORY_SECONDS:
            self.left.popleft()

    def published(self) -> int:
        return sum(n for _t, n in self.left)


class Dashboard:
    """State of one dashboard: the sampled history and the configuration."""

    def __init__(
        self,
        dsn: str,
        *,
        table: str = "outbox",
        tasks_table: str = DEFAULT_TASKS_TABLE,
        admin_token: str | None = None,
        sample_interval: float = 2.0,
        host: str | None = None,
        allowed_hosts: Iterable[str] = (),
        max_topics: int = DEFAULT_MAX_TOPICS,
        token_failure_window: float = TOKEN_FAILURE_WINDOW,
    ) -> None:
        """``host``: the address it is served on; with ``allowed_hosts``, the Host names
        it answers to besides IP addresses and localhost. ``tasks_table``: the task table
        its Tasks page shows (task mode; the page says how to create it when missing)."""
        if admin_token and len(admin_token) < MIN_TOKEN_CHARS:
            raise ConfigurationError(
                f"the admin token is {len(admin_token)} characters long; use at least"
                f" {MIN_TOKEN_CHARS} random ones, e.g. `openssl rand -hex 16`"
            )
        self.dsn = dsn
        remember_secrets(dsn)
        self.table = table
        parse_table(tasks_table)  # a bad name is refused now, not at the page's first read
        self.tasks_table = tasks_table
        self.admin_token = admin_token or None
        self.sample_interval = sample_interval
        self.max_topics = max_topics
        self.allowed_hosts = _allowed_hosts(host, allowed_hosts)
        #: The database's operator functions (PostgreSQL's or MariaDB's, by the URL).
        self.admin = admin_for(dsn)
        self.connections = _Connections(dsn, self.admin)
        self.attempts = _TokenAttempts(window=token_failure_window)
        self.history: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=max(2, int(HISTORY_SECONDS / sample_interval) + 1)
        )
        self.latest: LiveStatus | None = None
        self.error: str | None = None
        self._previous: tuple[float, int, int] | None = None
        self._topics: dict[str, _RecentTopic] = {}  # listed topic -> its recent activity

    async def sample(self) -> None:
        """Read the table once and append a point to the history."""
        try:
            live = await self.connections.run(self.admin.live_status, self.table)
        except Exception as exc:
            error = redact(f"{type(exc).__name__}: {exc}")[:500]
            if error != self.error:  # once per outage, not once per sample
                log.warning("dashboard: reading the outbox failed: %s", error)
            self.error = error
            return
        if self.error is not None:
            log.info("dashboard: reading the outbox works again")
        self.error = None
        now = time.time()
        s = live.status
        s.topics = self._bounded_topics(s.topics, now)
        remaining = s.pending + s.in_flight + s.failed
        throughput: float | None = None
        if self._previous is not None:
            t0, last_id0, remaining0 = self._previous
            # Rows written since the last sample, minus the growth of what is still
            # in the table, left it: published (or discarded) per second.
            left = (live.last_id - last_id0) - (remaining - remaining0)
            throughput = max(0.0, left / max(now - t0, 1e-6))
        self._previous = (now, live.last_id, remaining)
        self.latest = live
        self.history.append(
            {
                "t": now,
                "backlog": s.pending,
                "in_flight": s.in_flight,
                "failed": s.failed,
                "throughput": throughput,
            }
        )

    def _bounded_topics(self, topics: list[TopicStatus], now: float) -> list[TopicStatus]:
        """The busiest ``max_topics`` topics, the rest summed as one row, with recent activity.

        A topic the sampler saw with rows stays listed for the charts' window
        (``HISTORY_SECONDS``) after its last row left, so a topic whose events were all
        published (and deleted) does not vanish; its ``published`` then counts the rows that
        left the table in that window. That count comes from this dashboard's own samples,
        not from the write path or the relay, which pay nothing for it: between two
        samples, a topic's pending and in-flight rows that went down by more than its
        failed rows went up were published. It is a lower bound: rows
        written and published between two samples are never seen, and a topic written
        and drained entirely between two samples is not listed. Topics past
        ``max_topics`` are summed in ``(other)`` and not followed.
        """
        topics.sort(key=lambda t: (-(t.pending + t.in_flight + t.failed), t.topic))
        listed, rest = topics[: self.max_topics], topics[self.max_topics :]
        for t in listed:
            recent = self._topics.setdefault(t.topic, _RecentTopic())
            recent.observe(t, now)
            t.published = recent.published()
        present = {t.topic for t in listed}
        for name, recent in list(self._topics.items()):
            if name in present:
                continue
            if now - recent.last_seen > HISTORY_SECONDS or len(listed) >= self.max_topics:
                del self._topics[name]  # drained for the whole window, or crowded out
                continue
            recent.observe(None, now)
            listed.append(TopicStatus(name, 0, 0, 0, recent.published(), None))
        if rest:
            other = TopicStatus(OTHER_TOPICS, 0, 0, 0, 0, None)
            for t in rest:
                other.add(t)
            listed.append(other)
        listed.sort(key=lambda t: (t.topic == OTHER_TOPICS, t.topic))
        return listed

    async def run_sampler(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.sample_interval)

    def authorized(self, request: web.Request) -> bool:
        given = request.headers.get(TOKEN_HEADER, "")
        return self.admin_token is not None and hmac.compare_digest(
            given.encode(), self.admin_token.encode()
        )

    def host_allowed(self, request: web.Request) -> bool:
        """Whether the Host header names this dashboard (not a name rebound to it)."""
        raw = request.headers.get("Host")
        if raw is None:
            return True  # HTTP/1.0 without Host: not a browser, so not DNS rebinding
        return _host_ok(raw, self.allowed_hosts)


def _allowed_hosts(host: str | None, extra: Iterable[str]) -> frozenset[str]:
    names = {h.strip().lower().rstrip(".") for h in extra if h.strip()}
    names.add(socket.gethostname().lower())
    if host:
        names.add(host.lower().strip("[]"))
    return frozenset(names)


def _host_ok(raw: str, allowed: frozenset[str]) -> bool:
    """IP literals and localhost always; other names only when allowed.

    A DNS rebinding attack makes a browser send the attacker's name as Host; it
    can never make it send an IP literal or a name the operator listed.
    """
    host = raw.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    host = host.rstrip(".")
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host == "localhost" or host.endswith(".localhost") or host in allowed


class _TokenAttempts:
    """Wrong admin tokens per client address, and in all, over a sliding window."""

    def __init__(
        self,
        per_client: int = TOKEN_FAILURES_ALLOWED,
        in_all: int = TOKEN_FAILURES_ALLOWED_IN_ALL,
        window: float = TOKEN_FAILURE_WINDOW,
    ) -> None:
        self.per_client = per_client
        self.in_all = in_all
        self.window = window
        self._failures: collections.deque[tuple[float, str]] = collections.deque()
        self._log = Throttled(log, window)

    def _expire(self, now: float) -> None:
        while self._failures and now - self._failures[0][0] > self.window:
            self._failures.popleft()

    def retry_after(self, who: str) -> float | None:
        """Seconds until ``who`` may try again; None when it may try now."""
        now = time.monotonic()
        self._expire(now)
        mine = [t for t, w in self._failures if w == who]
        if len(mine) >= self.per_client:
            return self.window - (now - mine[-self.per_client])
        if len(self._failures) >= self.in_all:
            return self.window - (now - self._failures[-self.in_all][0])
        return None

    def failed(self, who: str, what: str) -> None:
        now = time.monotonic()
        self._failures.append((now, who))
        # the deque never holds more than the global allowance plus one window's refusals
        while len(self._failures) > 2 * self.in_all:
            self._failures.popleft()
        self._log(
            logging.WARNING,
            "dashboard: refused %s from %s: wrong admin token",
            what,
            who,
        )


class _Connections:
    """A few database connections the dashboard reuses, and a bound on their use.

    One new connection per request let a busy page (or a hostile client) take
    every connection the database allows, the relay's included.
    """

    def __init__(self, dsn: str, admin: Admin, size: int = POOL_SIZE) -> None:
        self.dsn = dsn
        self.admin = admin
        self.size = size
        self.opened = 0
        self.closed = False
        self._idle: list[Any] = []
        self._slots: asyncio.Semaphore | None = None

    async def run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(connection, *args, **kwargs)`` in a thread, on a kept connection."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            try:
                return await asyncio.to_thread(self._call, fn, args, kwargs, reuse=True)
            except self.admin.connection_lost:
                # a kept connection the server closed meanwhile: once more on a new one
                return await asyncio.to_thread(self._call, fn, args, kwargs, reuse=False)

    def _call(self, fn: Callable[..., _T], args: Any, kwargs: Any, *, reuse: bool) -> _T:
        conn = self._idle.pop() if reuse and self._idle else None
        if conn is None or not self.admin.usable(conn):
            conn = self.admin.connect(self.dsn)
            self.opened += 1
        try:
            result = fn(conn, *args, **kwargs)
        except BaseException:
            conn.close()
            raise
        if self.closed:  # a call still running when the app stopped
            conn.close()
        else:
            self._idle.append(conn)
        return result

    def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().close()


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, default=str))


def _limit(request: web.Request) -> int:
    try:
        return max(1, min(int(request.query.get("limit", "100")), 1000))
    except ValueError:
        raise web.HTTPBadRequest(text="limit must be a number of rows") from None


def _row_id(
    request: web.Request, what: str = "event ids in the dashboard are outbox row ids"
) -> int:
    ref = request.match_info["id"]
    # str.isdigit() admits "²" and other digits int() refuses: ASCII only, and within bigint
    if not (ref.isascii() and ref.isdigit()) or len(ref) > 19 or int(ref) > _MAX_ROW_ID:
        raise web.HTTPBadRequest(text=f"{what} (digits)")
    return int(ref)


def _refusal(dashboard: Dashboard, request: web.Request, what: str) -> web.Response | None:
    """Why an action may not run (read-only, slowed down, wrong token), or None: it may."""
    if dashboard.admin_token is None:
        return _json({"error": "the dashboard is read-only: restart it with --admin-token"}, 403)
    who = request.remote or "unknown"
    wait = dashboard.attempts.retry_after(who)
    if wait is not None:
        return web.json_response(
            {"error": "too many wrong admin tokens: try again later"},
            status=429,
            headers={"Retry-After": str(max(1, int(wait + 1)))},
        )
    if not dashboard.authorized(request):
        dashboard.attempts.failed(who, what)
        return _json({"error": "wrong or missing admin token"}, 403)
    return None


def _redacted_error(row: dict[str, Any]) -> dict[str, Any]:
    """``last_error`` masked again: rows written by older versions may quote a secret."""
    if row.get("last_error"):
        row["last_error"] = redact(str(row["last_error"]))
    return row


def _payload_text(payload: bytes) -> tuple[str, str, bool]:
    """(text, kind, truncated): JSON pretty-printed, other bytes as UTF-8 with replacements."""
    truncated = len(payload) > MAX_PAYLOAD_CHARS
    try:
        text = json.dumps(json.loads(payload), indent=2, ensure_ascii=False)
        kind = "json"
    except (ValueError, RecursionError):  # nested 3 000 levels deep: shown as its text
        text = payload.decode("utf-8", "replace")
        kind = "text"
    if len(text) > MAX_PAYLOAD_CHARS:
        text, truncated = text[:MAX_PAYLOAD_CHARS], True
    return text, kind, truncated


def _secure(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(_SECURITY_HEADERS)
    if request.path.startswith("/api/"):
        response.headers["Cache-Control"] = "no-store"


def dashboard_app(dashboard: Dashboard) -> web.Application:
    """The aiohttp application: the page, its assets and the JSON API."""

    from outboxkit.ops.dashboard.tasks import add_task_routes

    async def index(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    async def overview(_request: web.Request) -> web.Response:
        if dashboard.latest is None:
            await dashboard.sample()
        live = dashboard.latest
        return _json(
            {
                "table": dashboard.table,
                "read_only": dashboard.admin_token is None,
                "error": dashboard.error,
                "sample_interval": dashboard.sample_interval,
                "status": asdict(live.status) if live else None,
                "truncated": live.truncated if live else False,
                "history": list(dashboard.history),
                "now": time.time(),
            }
        )

    async def failed(request: web.Request) -> web.Response:
        limit = _limit(request)
        rows = await dashboard.connections.run(
            dashboard.admin.list_failed, dashboard.table, limit=limit
        )
        return _json([_redacted_error(row) for row in rows])

    async def blocked(request: web.Request) -> web.Response:
        """Ordered mode: keys stopped behind a dead-lettered head event, with its error."""
        limit = _limit(request)
        rows = await dashboard.connections.run(
            dashboard.admin.blocked_keys, table=dashboard.table, limit=limit
        )
        return _json([_redacted_error(row) for row in rows])

    async def event(request: web.Request) -> web.Response:
        row = await dashboard.connections.run(
            dashboard.admin.get_event, str(_row_id(request)), dashboard.table
        )
        if row is None:
            return _json({"error": "no such event (published and deleted, or discarded)"}, 404)
        payload = bytes(row.pop("payload"))
        text, kind, truncated = _payload_text(payload)
        row.update(
            headers=mask_headers(row.get("headers")),
            payload=text,
            payload_kind=kind,
            payload_bytes=len(payload),
            payload_truncated=truncated,
        )
        return _json(_redacted_error(row))

    def action(
        name: str, done: str, run: Callable[[int], Awaitable[int]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            row_id = _row_id(request)
            refused = _refusal(dashboard, request, f"{name} of event row {row_id}")
            if refused is not None:
                return refused
            n = await run(row_id)
            log.warning(
                "dashboard: %s of failed event row %d by %s: %d row(s) changed",
                name,
                row_id,
                request.remote,
                n,
                extra={"action": name, "row_id": row_id, "changed": n},
            )
            if n == 0:
                return _json({"error": f"event {row_id} is not a failed event (any more)"}, 409)
            await dashboard.sample()
            return _json({done: n})

        return handler

    async def replay(row_id: int) -> int:
        return await dashboard.connections.run(
            dashboard.admin.replay, dashboard.table, ids=[row_id]
        )

    async def discard(row_id: int) -> int:
        return await dashboard.connections.run(
            dashboard.admin.discard, dashboard.table, ids=[row_id]
        )

    @web.middleware
    async def known_host(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not dashboard.host_allowed(request):
            return web.Response(
                status=403,
                text="this dashboard does not answer to that Host name: open it by IP address"
                " or localhost, or start it with --allow-host NAME\n",
            )
        return await handler(request)

    @web.middleware
    async def security_headers(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # a 400 or 404 raised is answered with them too
            _secure(request, exc)
            raise
        _secure(request, response)
        return response

    app = web.Application(middlewares=[security_headers, known_host])
    app[_APP_KEY] = dashboard
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/overview", overview)
    app.router.add_get("/api/failed", failed)
    app.router.add_get("/api/blocked", blocked)
    app.router.add_get("/api/events/{id}", event)
    app.router.add_post("/api/events/{id}/replay", action("replay", "replayed", replay))
    app.router.add_post("/api/events/{id}/discard", action("discard", "discarded", discard))
    add_task_routes(app, dashboard)

    async def sampler(_app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(dashboard.run_sampler())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.to_thread(dashboard.connections.close)

    app.cleanup_ctx.append(sampler)
    return app
