"""A scripted AWS JSON endpoint: the answers moto never gives (throttling, partial failures).

moto accepts every well-formed ``PutRecords`` and ``PutEvents``; a real Kinesis shard
over its write limit refuses records with ``ProvisionedThroughputExceededException``,
and EventBridge refuses single entries with their own codes. This server speaks the
JSON 1.1 protocol boto3 uses for both over real HTTP on loopback: each request is
recorded, and answered by the test's ``answer(target, request) -> response``.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable
from typing import Any

from outboxkit.testing import free_port

Answer = Callable[[str, dict[str, Any]], dict[str, Any]]


class ScriptedAws:
    """``answer`` decides each reply; ``requests`` holds (target, body) in arrival order."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.port = free_port()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
                target = self.headers.get("x-amz-target", "").rpartition(".")[2]
                outer.requests.append((target, body))
                reply = json.dumps(outer.answer(target, body)).encode()
                self.send_response(200)
                self.send_header("content-type", "application/x-amz-json-1.1")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedAws:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
