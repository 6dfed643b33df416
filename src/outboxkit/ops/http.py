"""The relay's HTTP endpoints: /metrics (Prometheus), /healthz, /readyz and /dashboard/.

They run in the relay's own event loop (aiohttp), so a wedged loop shows up as a
failing ``/healthz`` instead of a process that looks alive. Because they share
that loop with the relay, nothing served here may hold it: the scrape renders in
a thread, and every server outboxkit runs goes through :class:`GuardedSite`,
which bounds connections and header time so slow or many clients cannot starve
the relay of file descriptors (its database and broker connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import resource
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from outboxkit._redact import redact
from outboxkit.errors import ConfigurationError
from outboxkit.ops._throttle import Throttled

log = logging.getLogger("outboxkit.http")


class Scraped(Protocol):
    """What /metrics and /readyz read: a relay's :class:`RelayMetrics`, or a fleet's."""

    @property
    def registry(self) -> CollectorRegistry: ...

    def not_ready_reason(self) -> str | None: ...


@dataclass(frozen=True)
class ServerLimits:
    """What one HTTP client, or many, may take from a process that also relays events."""

    #: Connections served at once; more are answered 503 and closed at once.
    max_connections: int = 64
    #: Seconds a connection may take to send its request line and headers.
    header_timeout: float = 10.0
    #: Seconds an idle keep-alive connection is kept (a browser polls every 2 s).
    keepalive_timeout: float = 5.0
    #: Never more than this fraction of the soft open-file limit goes to HTTP clients.
    fd_share: float = 0.25

    def connection_cap(self) -> int:
        """``max_connections``, lowered to leave the relay's own sockets their descriptors."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(4, min(self.max_connections, int(soft * self.fd_share)))


DEFAULT_LIMITS = ServerLimits()
#: Seconds between two log lines about refused connections or failing accepts.
_LOG_EVERY = 30.0
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 32\r\nConnection: close\r\n\r\ntoo many connections, try later\n"
)


class _Gate:
    """Counts a site's open connections and keeps them under the cap.

    At the cap, the connection that has waited longest for its headers is
    dropped to make room (a slow-loris client, most likely: a real one sends its
    headers in a millisecond), so a health probe still gets through a flood;
    only when every connection is busy with a request is the newcomer refused.
    """

    def __init__(self, cap: int, where: str) -> None:
        self.cap = cap
        self.where = where
        self.open = 0
        self.refused = 0
        self.dropped = 0
        self.waiting: dict[_GuardedProtocol, None] = {}  # in header phase, oldest first
        self._log = Throttled(log, _LOG_EVERY)

    def admit(self) -> bool:
        if self.open >= self.cap and self.waiting:
            self.dropped += 1
            next(iter(self.waiting)).drop()
            self._log(
                logging.WARNING,
                "http %s: %d connections open (the cap), dropping the slowest to send its"
                " headers (%d dropped, %d refused so far)",
                self.where,
                self.cap,
                self.dropped,
                self.refused,
            )
        if self.open >= self.cap:
            self.refused += 1
            self._log(
                logging.WARNING,
                "http %s: %d connections busy (the cap), refusing more (%d refused so far)",
                self.where,
                self.open,
                self.refused,
            )
            return False
        self.open += 1
        return True


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol behind a connection cap and a header deadline.

    aiohttp reads headers for as long as a client cares to send them; 1 100
    such clients held every descriptor of the relay (slow loris). Any bytes
    after a complete header block start the next request's headers (the
    endpoints take no request bodies), so keep-alive requests are bounded too.
    """

    def __init__(self, inner: asyncio.Protocol, gate: _Gate, header_timeout: float) -> None:
        self._inner = inner
        self._gate = gate
        self._header_timeout = header_timeout
        self._counted = False  # holds one of the gate's slots
        self._started = False  # the inner protocol saw connection_made
        self._deadline: asyncio.TimerHandle | None = None
        self._tail = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transport (uvloop's TCPTransport is one without being an
        # asyncio.Transport subclass: no isinstance check here).
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        if not self._gate.admit():
            transport.write(_BUSY)
            transport.close()
            return
        self._counted = self._started = True
        self._await_headers()
        self._inner.connection_made(transport)

    def _await_headers(self) -> None:
        self._gate.waiting[self] = None
        self._deadline = asyncio.get_running_loop().call_later(self._header_timeout, self.drop)

    def _headers_done(self) -> None:
        self._gate.waiting.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _release(self) -> None:
        self._headers_done()
        if self._counted:
            self._counted = False
            self._gate.open -= 1

    def drop(self) -> None:
        """Close the connection now (too slow, or making room for a new one)."""
        self._release()
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self._started:
            return
        if self._deadline is None and self._counted:
            self._await_headers()
            self._tail = b""
        if self._deadline is not None:
            seen = self._tail + data
            if b"\r\n\r\n" in seen:
                self._headers_done()
                self._tail = b""
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._started else None

    def pause_writing(self) -> None:
        if self._started:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._started:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        self._transport = None
        if self._started:
            self._started = False
            self._inner.connection_lost(exc)


class GuardedSite(web.BaseSite):
    """A TCP site whose connections are capped and must send their headers in time."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        limits: ServerLimits = DEFAULT_LIMITS,
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._limits = limits
        self.gate = _Gate(limits.connection_cap(), f"{host}:{port}")
        self._acceptors: list[_Acceptor] = []

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        """The bound port (the real one when asked for port 0)."""
        sockets = getattr(self._server, "sockets", None)
        return int(sockets[0].getsockname()[1]) if sockets else self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        gate, timeout = self.gate, self._limits.header_timeout

        def protocol() -> asyncio.Protocol:
            return _GuardedProtocol(server(), gate, timeout)

        loop = asyncio.get_running_loop()
        # Bound and listening, but accepted by _Acceptor, not by asyncio (see there).
        self._server = await loop.create_server(
            protocol,
            self._host,
            self._port,
            backlog=_BACKLOG,
            reuse_address=True,
            start_serving=False,
        )
        self.gate.where = f"{self._host}:{self.port}"
        failures = Throttled(log, _LOG_EVERY)
        for listening in self._server.sockets:
            acceptor = _Acceptor(loop, listening, protocol, failures)
            self._acceptors.append(acceptor)
            acceptor.start()

    async def stop(self) -> None:
        for acceptor in self._acceptors:
            acceptor.close()
        self._acceptors.clear()
        await super().stop()


#: Seconds to wait before accepting again on a socket whose accept() ran out of descriptors.
_ACCEPT_RETRY = 1.0
#: Connections the kernel queues for a listening socket, and accepted per wake-up.
_BACKLOG = 128
_ACCEPT_BATCH = _BACKLOG
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _Acceptor:
    """Accepts one listening socket's connections, and backs off once when out of descriptors.

    asyncio's own accept loop goes on after EMFILE: up to its backlog of failing accept()
    calls in one tick, each reported and each scheduling a retry, so the retries
    multiplied (4 755 failed accepts in 30 s of a starved relay, growing). Here the first
    failure stops the loop and one retry follows a second later; the log line is throttled.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        listening: Any,
        protocol: Callable[[], asyncio.Protocol],
        failures: Throttled,
    ) -> None:
        self._loop = loop
        # Our own handle on the listening socket (asyncio's wrapper has no accept()):
        # a duplicate descriptor of the same socket, closed with the site.
        self._sock = socket.fromfd(listening.fileno(), listening.family, listening.type)
        self._sock.setblocking(False)
        self._sock.listen(_BACKLOG)  # asyncio listens only when it serves itself
        self._protocol = protocol
        self._failures = failures
        self._retry: asyncio.TimerHandle | None = None
        self._connecting: set[asyncio.Task[Any]] = set()
        self._closed = False

    def start(self) -> None:
        self._retry = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _address = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # nothing more waiting
            except OSError as exc:
                self._loop.remove_reader(self._sock.fileno())
                self._retry = self._loop.call_later(_ACCEPT_RETRY, self.start)
                if exc.errno in _OUT_OF_RESOURCES:
                    self._failures(
                        logging.ERROR,
                        "http %s: socket.accept() out of system resource: %s; new connections"
                        " wait until descriptors are free: raise the open-file limit (ulimit -n,"
                        " systemd LimitNOFILE=)",
                        _address_of(self._sock),
                        exc,
                    )
                else:
                    self._failures(
                        logging.ERROR, "http %s: accept() failed: %s", _address_of(self._sock), exc
                    )
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._protocol, conn)
        except Exception:  # the client left before its transport was made, most likely
            log.debug("http: an accepted connection failed", exc_info=True)
            conn.close()


def _address_of(sock: socket.socket) -> str:
    """host:port of a listening socket, for a log line."""
    try:
        name = sock.getsockname()
    except OSError:
        return "?"
    host = f"[{name[0]}]" if ":" in str(name[0]) else name[0]
    return f"{host}:{name[1]}"


def runner(app: web.Application, limits: ServerLimits = DEFAULT_LIMITS) -> web.AppRunner:
    """An AppRunner whose idle keep-alive connections (and slow later requests) time out."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=limits.keepalive_timeout)


class _Scrape:
    """Renders the registry in its own thread, one render at a time, shared by concurrent scrapes.

    ``generate_latest`` is plain Python: on the loop, a large registry stalled
    the relay for seconds (in-flight batches timed out and were published twice).
    """

    def __init__(
        self,
        metrics: Scraped,
        *,
        reuse_seconds: float = 1.0,
        refresh: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.metrics = metrics
        self.refresh = refresh
        self.reuse_seconds = reuse_seconds
        self.renders = 0
        self._body = b""
        self._rendered_at = -reuse_seconds
        self._running: asyncio.Task[bytes] | None = None
        # its own thread: the loop's default executor may be full of blocking calls
        self._thread: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None

    async def body(self) -> bytes:
        if time.monotonic() - self._rendered_at < self.reuse_seconds:
            return self._body
        if self._running is None:
            self._running = asyncio.create_task(self._render())
        # shield: a scraper that hangs up must not cancel the render others wait for
        return await asyncio.shield(self._running)

    async def _render(self) -> bytes:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="outboxkit-scrape")
        loop = asyncio.get_running_loop()
        try:
            if self.refresh is not None:
                await self.refresh()
            body = await loop.run_in_executor(self._thread, _render, self.metrics.registry)
            self.renders += 1
            self._body, self._rendered_at = body, time.monotonic()
            return body
        finally:
            self._running = None


#: Where the app keeps its scrape renderer (``app[SCRAPE_KEY].renders`` counts renders).
SCRAPE_KEY = web.AppKey("scrape", _Scrape)


def _render(registry: CollectorRegistry) -> bytes:
    """``generate_latest`` with the cyclic garbage collector paused.

    A render allocates objects per sample; with a large registry those
    allocations set off full collections, which hold the GIL, and so the relay's
    loop, for hundreds of milliseconds on a big heap. The render makes no cycles;
    collection resumes when it returns.
    """
    if not gc.isenabled():
        return generate_latest(registry)
    gc.disable()
    try:
        return generate_latest(registry)
    finally:
        gc.enable()


def metrics_app(
    metrics: Scraped,
    *,
    dashboard: web.Application | None = None,
    refresh: Callable[[], Awaitable[None]] | None = None,
) -> web.Application:
    """The aiohttp application serving one relay's metrics and health (and the dashboard).
    ``refresh``: awaited before each render (a worker fleet's table gauges, read then)."""
    scraper = _Scrape(metrics, refresh=refresh)

    async def scrape(_request: web.Request) -> web.Response:
        body = await scraper.body()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_request: web.Request) -> web.Response:
        reason = metrics.not_ready_reason()
        if reason is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {redact(reason)}\n")

    app = web.Application()
    app[SCRAPE_KEY] = scraper

    async def stop_rendering(_app: web.Application) -> None:
        scraper.close()

    app.on_cleanup.append(stop_rendering)
    app.router.add_get("/metrics", scrape)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if dashboard is not None:

        async def to_dashboard(_request: web.Request) -> web.Response:
            raise web.HTTPFound("/dashboard/")

        app.router.add_get("/dashboard", to_dashboard)
        app.add_subapp("/dashboard/", dashboard)
    return app


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one; return the soft limit now in force.

    Distributions start services at a soft limit of 1024 while allowing far more:
    the relay should not be the process that runs out first.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
    return soft


@contextlib.asynccontextmanager
async def serving(
    app: web.Application,
    host: str,
    port: int,
    *,
    limits: ServerLimits = DEFAULT_LIMITS,
    what: str = "/metrics /healthz /readyz",
    option: str = "--metrics-port",
) -> AsyncIterator[GuardedSite]:
    """Serve ``app`` on host:port for the duration of the block, behind :class:`ServerLimits`."""
    run = runner(app, limits)
    await run.setup()
    try:
        site = GuardedSite(run, host, port, limits=limits)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve {what} on {host}:{port} ({exc.strerror or exc});"
                f" choose another {option}"
            ) from None
        log.info(
            "serving http://%s:%d (%s; at most %d connections)",
            host,
            site.port,
            what,
            site.gate.cap,
        )
        yield site
    finally:
        await run.cleanup()
