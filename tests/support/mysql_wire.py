"""A loopback TCP proxy that reads the MySQL protocol: it counts round trips and cuts at one.

Every command a client sends starts a packet with sequence id 0 (the handshake's packets
have higher ids), so counting those counts the client's round trips, whatever the driver.
``cut_at_next(forward=...)`` ends the client's connection at its next command: before the
server sees it (``forward=False``: the server sees a client vanish mid-transaction) or after
forwarding it with the server's side kept open (``forward=True``: the server runs it to the
end, the client never hears back, as when the network fails with the COMMIT in flight).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Self

_HEADER = 4


class CountingProxy:
    """127.0.0.1:``port`` forwarded to ``target_port``; ``commands`` counts client commands."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self.commands = 0
        self.queries: list[bytes] = []  # each COM_QUERY's text, in order
        self._cut: bool | None = None  # None: forward; else cut at the next command
        self._kept: list[socket.socket] = []  # server sides kept open after a cut
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_at_next(self, *, forward: bool) -> None:
        with self._lock:
            self._cut = forward

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._to_server, args=(client, server), daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client), daemon=True).start()

    def _to_server(self, client: socket.socket, server: socket.socket) -> None:
        buffer = b""
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                _close(client, server)
                return
            buffer += data
            while len(buffer) >= _HEADER:
                length = int.from_bytes(buffer[:3], "little")
                if len(buffer) < _HEADER + length:
                    break
                packet, buffer = buffer[: _HEADER + length], buffer[_HEADER + length :]
                if packet[3] != 0:
                    server.sendall(packet)  # the handshake's, or a long command's rest
                elif not self._command(packet, client, server):
                    return

    def _command(self, packet: bytes, client: socket.socket, server: socket.socket) -> bool:
        """Count a command; False if the connection was cut at it."""
        with self._lock:
            self.commands += 1
            if packet[4:5] == b"\x03":
                self.queries.append(packet[5:])
            cut, self._cut = self._cut, None
        if cut is None:
            server.sendall(packet)
            return True
        if cut:
            self._kept.append(server)  # the server's side stays open: it runs the command
            _close(client)  # (first: the client never hears back)
            server.sendall(packet)
        else:
            _close(client, server)
        return False

    def _to_client(self, server: socket.socket, client: socket.socket) -> None:
        while True:
            try:
                data = server.recv(65536)
            except OSError:
                data = b""
            if not data or server in self._kept:
                if server not in self._kept:
                    _close(server, client)
                return
            try:
                client.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        _close(*self._kept)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
