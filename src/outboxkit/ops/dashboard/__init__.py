"""``outboxkit dashboard``: one web page to watch an outbox and handle its dead letters.

An aiohttp server with a small JSON API and one static page (vanilla JS, inline
SVG charts, no build step). Read-only unless started with an admin token;
replay and discard require it in the ``X-Outboxkit-Token`` header and are
logged. The page renders every value with ``textContent``: payloads and errors
are attacker-controlled text.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aiohttp import web

from outboxkit._redact import redact
from outboxkit.store import admin

log = logging.getLogger("outboxkit.dashboard")

STATIC = Path(__file__).parent / "static"
#: History kept for the charts.
HISTORY_SECONDS = 15 * 60
#: Payload bytes shown in the event view; the rest is cut (and said so).
MAX_PAYLOAD_CHARS = 64 * 1024
TOKEN_HEADER = "X-Outboxkit-Token"  # noqa: S105 - a header name, not a secret
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


class Dashboard:
    """State of one dashboard: the sampled history and the configuration."""

    def __init__(
        self,
        dsn: str,
        *,
        table: str = "outbox",
        admin_token: str | None = None,
        sample_interval: float = 2.0,
    ) -> None:
        self.dsn = dsn
        self.table = table
        self.admin_token = admin_token or None
        self.sample_interval = sample_interval
        self.history: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=max(2, int(HISTORY_SECONDS / sample_interval) + 1)
        )
        self.latest: admin.LiveStatus | None = None
        self.error: str | None = None
        self._previous: tuple[float, int, int] | None = None
        self._topics: set[str] = set()

    async def sample(self) -> None:
        """Read the table once and append a point to the history."""
        try:
            live = await asyncio.to_thread(admin.live_status, self.dsn, self.table)
        except Exception as exc:
            self.error = redact(f"{type(exc).__name__}: {exc}")[:500]
            log.warning("dashboard: reading the outbox failed: %s", self.error)
            return
        self.error = None
        now = time.time()
        s = live.status
        # A topic that drained stays in the table with zeros instead of vanishing.
        shown = {t.topic for t in s.topics}
        s.topics.extend(admin.TopicStatus(t, 0, 0, 0, 0, None) for t in self._topics - shown)
        s.topics.sort(key=lambda t: t.topic)
        self._topics |= shown
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

    async def run_sampler(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.sample_interval)

    def authorized(self, request: web.Request) -> bool:
        given = request.headers.get(TOKEN_HEADER, "")
        return self.admin_token is not None and hmac.compare_digest(
            given.encode(), self.admin_token.encode()
        )


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, default=str))


def _row_id(request: web.Request) -> int:
    ref = request.match_info["id"]
    if not ref.isdigit():
        raise web.HTTPBadRequest(text="event ids in the dashboard are outbox row ids (digits)")
    return int(ref)


def _payload_text(payload: bytes) -> tuple[str, str, bool]:
    """(text, kind, truncated): JSON pretty-printed, other bytes as UTF-8 with replacements."""
    truncated = len(payload) > MAX_PAYLOAD_CHARS
    try:
        text = json.dumps(json.loads(payload), indent=2, ensure_ascii=False)
        kind = "json"
    except ValueError:
        text = payload.decode("utf-8", "replace")
        kind = "text"
    if len(text) > MAX_PAYLOAD_CHARS:
        text, truncated = text[:MAX_PAYLOAD_CHARS], True
    return text, kind, truncated


def dashboard_app(dashboard: Dashboard) -> web.Application:
    """The aiohttp application: the page, its assets and the JSON API."""

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
        try:
            limit = max(1, min(int(request.query.get("limit", "100")), 1000))
        except ValueError:
            raise web.HTTPBadRequest(text="limit must be a number of rows") from None
        rows = await asyncio.to_thread(
            admin.list_failed, dashboard.dsn, dashboard.table, limit=limit
        )
        return _json(rows)

    async def event(request: web.Request) -> web.Response:
        row = await asyncio.to_thread(
            admin.get_event, dashboard.dsn, str(_row_id(request)), dashboard.table
        )
        if row is None:
            return _json({"error": "no such event (published and deleted, or discarded)"}, 404)
        payload = bytes(row.pop("payload"))
        text, kind, truncated = _payload_text(payload)
        row.update(
            payload=text,
            payload_kind=kind,
            payload_bytes=len(payload),
            payload_truncated=truncated,
        )
        return _json(row)

    def action(
        name: str, done: str, run: Callable[[int], Awaitable[int]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            row_id = _row_id(request)
            if dashboard.admin_token is None:
                return _json(
                    {"error": "the dashboard is read-only: restart it with --admin-token"}, 403
                )
            if not dashboard.authorized(request):
                log.warning(
                    "dashboard: refused %s of event row %d from %s: wrong admin token",
                    name,
                    row_id,
                    request.remote,
                )
                return _json({"error": "wrong or missing admin token"}, 403)
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
        return await asyncio.to_thread(admin.replay, dashboard.dsn, dashboard.table, ids=[row_id])

    async def discard(row_id: int) -> int:
        return await asyncio.to_thread(admin.discard, dashboard.dsn, dashboard.table, ids=[row_id])

    @web.middleware
    async def security_headers(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        response = await handler(request)
        response.headers.update(_SECURITY_HEADERS)
        if request.path.startswith("/api/"):
            response.headers["Cache-Control"] = "no-store"
        return response

    app = web.Application(middlewares=[security_headers])
    app[_APP_KEY] = dashboard
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/overview", overview)
    app.router.add_get("/api/failed", failed)
    app.router.add_get("/api/events/{id}", event)
    app.router.add_post("/api/events/{id}/replay", action("replay", "replayed", replay))
    app.router.add_post("/api/events/{id}/discard", action("discard", "discarded", discard))

    async def sampler(_app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(dashboard.run_sampler())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(sampler)
    return app
