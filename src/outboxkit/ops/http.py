"""The relay's HTTP endpoints: /metrics (Prometheus), /healthz, /readyz and /dashboard/.

They run in the relay's own event loop (aiohttp), so a wedged loop shows up as a
failing ``/healthz`` instead of a process that looks alive.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from outboxkit.errors import ConfigurationError
from outboxkit.ops.metrics import RelayMetrics

log = logging.getLogger("outboxkit.http")


def metrics_app(
    metrics: RelayMetrics, *, dashboard: web.Application | None = None
) -> web.Application:
    """The aiohttp application serving one relay's metrics and health (and the dashboard)."""

    async def scrape(_request: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_request: web.Request) -> web.Response:
        reason = metrics.not_ready_reason()
        if reason is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {reason}\n")

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if dashboard is not None:

        async def to_dashboard(_request: web.Request) -> web.Response:
            raise web.HTTPFound("/dashboard/")

        app.router.add_get("/dashboard", to_dashboard)
        app.add_subapp("/dashboard/", dashboard)
    return app


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str, port: int) -> AsyncIterator[web.AppRunner]:
    """Serve ``app`` on host:port for the duration of the block."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc});"
                " choose another --metrics-port"
            ) from None
        log.info("serving http://%s:%d (/metrics /healthz /readyz)", host, port)
        yield runner
    finally:
        await runner.cleanup()
