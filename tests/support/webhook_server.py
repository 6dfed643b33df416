"""A real HTTP server in a thread that records every webhook POST and answers as scripted."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from outboxkit.testing import free_port


@dataclass(frozen=True)
class Received:
    """One request the webhook server got."""

    at: float  # time.monotonic()
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


@dataclass
class _Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class _QuietServer(http.server.ThreadingHTTPServer):
    allow_reuse_address = True
    request_queue_size = 128  # a relay opens many connections at once
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that hang up (a relay killed, a stopped test) are expected here


class WebhookServer:
    """An HTTP server in a thread that records every POST and answers as scripted.

    `answer(status, times=n, ...)` queues replies; when none is queued it answers 204.
    `stop()` closes the socket (clients get connection refused), `start()` reopens the port.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.requests: list[Received] = []
        self._replies: deque[_Reply] = deque()
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._connections: set[socket.socket] = set()
        self._thread: threading.Thread | None = None

    def url(self, path: str = "/hooks") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def answer(
        self,
        status: int,
        *,
        times: int = 1,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
    ) -> None:
        with self._lock:
            for _ in range(times):
                self._replies.append(_Reply(status, headers or {}, body))

    def start(self) -> None:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with owner._lock:
                    owner._connections.add(self.connection)

            def finish(self) -> None:
                with owner._lock:
                    owner._connections.discard(self.connection)
                super().finish()

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                with owner._lock:
                    owner.requests.append(
                        Received(
                            time.monotonic(),
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                        )
                    )
                    reply = owner._replies.popleft() if owner._replies else _Reply(204)
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = _QuietServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and reset open keep-alive connections: the receiver is gone."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            connections, self._connections = self._connections, set()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def received_ids(self) -> list[str]:
        with self._lock:
            return [r.headers["webhook-id"] for r in self.requests]
