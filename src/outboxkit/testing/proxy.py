"""A loopback TCP proxy to cut or stall the network between a client and a real server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

_T = TypeVar("_T")

_LOOPBACK = "127.0.0.1"
_CHUNK = 64 * 1024


class TcpProxy:
    """Forwards 127.0.0.1:`port` to `target_host`:`target_port` from a background thread.

    - `cut()` resets every open connection and closes new ones as soon as they are accepted,
      like a server whose network went away;
    - `pause()` keeps connections open but holds every byte, like a hung network (clients
      only notice through their own timeouts); new connections are accepted and held too;
    - `resume()` forwards again: held bytes are delivered, new connections go through;
    - `hold(port)` holds every byte of one connection only, the one the server sees coming
      from `port` (PostgreSQL's ``pg_stat_activity.client_port``): a black hole for, say,
      a LISTEN connection while the others go on.

    The methods are synchronous and thread-safe: when `cut()` returns, the connections are gone.
    """

    def __init__(self, target_host: str, target_port: int, listen_port: int | None = None) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self._listen_port = listen_port or 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="TcpProxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._mode = "forward"  # "forward" | "paused" | "cut"
        self._flowing = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Per connection, by its upstream socket's local port: set while it may forward.
        self._open: dict[int, asyncio.Event] = {}
        self.accepted = 0  # connections accepted since start, for tests to assert reconnects

    @property
    def port(self) -> int:
        """The port clients connect to."""
        if self._port is None:
            raise RuntimeError("TcpProxy.start() has not been called")
        return self._port

    @property
    def active_connections(self) -> int:
        """Client connections currently open through the proxy."""
        return self._call(self._count_clients())

    def start(self) -> Self:
        """Bind 127.0.0.1 and start forwarding."""
        if self._server is None:
            self._thread.start()
            self._server = self._call(self._start_server())
            self._port = int(self._server.sockets[0].getsockname()[1])
        return self

    def cut(self) -> None:
        """Reset all open connections and close every new one immediately."""
        self._call(self._set_mode("cut"))

    def pause(self) -> None:
        """Stop forwarding bytes while keeping the connections open."""
        self._call(self._set_mode("paused"))

    def resume(self) -> None:
        """Accept and forward again (after `cut()` or `pause()`)."""
        self._call(self._set_mode("forward"))

    def hold(self, client_port: int) -> None:
        """Stop forwarding on the one connection whose upstream side has local port
        `client_port`, keeping it open (its peers only notice through their own timeouts).
        KeyError if no open connection has that port."""
        self._call(self._hold(client_port))

    def close(self) -> None:
        """Stop listening, reset all connections and stop the thread."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self._call(self._shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------ inside the proxy's loop

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start_server(self) -> asyncio.Server:
        self._flowing.set()
        return await asyncio.start_server(
            self._handle, _LOOPBACK, self._listen_port, reuse_address=True
        )

    async def _hold(self, client_port: int) -> None:
        self._open[client_port].clear()

    async def _count_clients(self) -> int:
        return len(self._tasks)

    async def _set_mode(self, mode: str) -> None:
        self._mode = mode
        if mode == "forward":
            self._flowing.set()
        else:
            self._flowing.clear()
        if mode == "cut":
            self._reset_all()
            for task in list(self._tasks):
                task.cancel()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self._mode = "cut"
        self._reset_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()

    async def _handle(
        self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        self.accepted += 1
        if self._mode == "cut":
            _reset(client)
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(client)
        upstream: asyncio.StreamWriter | None = None
        try:
            await self._flowing.wait()  # a paused proxy holds new connections too
            if self._mode == "cut" or client not in self._writers:
                return
            try:
                upstream_reader, upstream = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
            except OSError:
                return
            self._writers.add(upstream)
            local_port = int(upstream.get_extra_info("sockname")[1])
            gate = self._open[local_port] = asyncio.Event()
            gate.set()
            try:
                await asyncio.gather(
                    self._pump(client_reader, upstream, gate),
                    self._pump(upstream_reader, client, gate),
                )
            finally:
                self._open.pop(local_port, None)
        except asyncio.CancelledError:
            # Only cut() and close() cancel a connection; ending quietly keeps asyncio from
            # logging the cancellation as an error of the connection callback (Python 3.11).
            pass
        finally:
            self._tasks.discard(task)
            for writer in (client, upstream):
                if writer is not None:
                    self._writers.discard(writer)
                    _reset(writer)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, gate: asyncio.Event
    ) -> None:
        """Copy bytes one way; at EOF close the other side gracefully, on an error reset it.

        Closing one side ends the opposite pump too (its reader sees EOF), so the handler ends.
        """
        try:
            while data := await reader.read(_CHUNK):
                await self._flowing.wait()
                await gate.wait()  # (held: never, the connection stays open)
                if writer.is_closing():
                    return
                writer.write(data)
                await writer.drain()
        except OSError:
            _reset(writer)
        else:
            if not writer.is_closing():
                writer.close()  # flushes what is buffered, then FIN


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0) so the peer sees a broken connection at once."""
    if writer.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
