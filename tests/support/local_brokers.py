"""The machine's RabbitMQ and Redis (checked, never reconfigured), and a Redis of a test's own.

The own `redis-server` runs on a free port with the AOF fsynced on every write, so a test
can SIGKILL it and restart it without losing anything it acknowledged.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

from outboxkit.testing import free_port, port_accepts
from tests.support.servers import require_or_skip

RABBITMQ_URL_ENV = "OUTBOXKIT_TEST_RABBITMQ_URL"
REDIS_URL_ENV = "OUTBOXKIT_TEST_REDIS_URL"
DEFAULT_RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def rabbitmq_url() -> str:
    """The RabbitMQ to test against (the machine's, unless OUTBOXKIT_TEST_RABBITMQ_URL says)."""
    url = os.environ.get(RABBITMQ_URL_ENV, DEFAULT_RABBITMQ_URL)
    parts = urlsplit(url)
    if not port_accepts(parts.port or 5672, host=parts.hostname or "127.0.0.1", timeout=2.0):
        require_or_skip(f"RabbitMQ at {url.split('@')[-1]} is not reachable")
    return url


def redis_url() -> str:
    """The Redis to test against (the machine's, unless OUTBOXKIT_TEST_REDIS_URL says)."""
    url = os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)
    parts = urlsplit(url)
    if not port_accepts(parts.port or 6379, host=parts.hostname or "127.0.0.1", timeout=2.0):
        require_or_skip(f"Redis at {url.split('@')[-1]} is not reachable")
    return url


class OwnRedis:
    """A `redis-server` on a free port with `appendfsync always`: kill it, restart it, keep data."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).exists():
            require_or_skip("redis-server is not installed")
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--protected-mode",
            "no",
        ]
        log = (self.directory / "redis.log").open("ab")
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not port_accepts(self.port, timeout=0.2):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {self._log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: what a crashed machine looks like; fsynced writes survive."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(10)
        self._proc = None

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "redis.log").read_text()[-2000:]
        return ""
