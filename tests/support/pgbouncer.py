"""A private PgBouncer in transaction pooling mode in front of the test PostgreSQL.

Debian's ``pgbouncer`` package (1.18 on these machines) provides the binary; the server is
a child process on a free loopback port with its own config and auth file in a temporary
directory, forwarding every database name to the PostgreSQL the session uses (the machine's
or the embedded one). Transaction pooling is the mode that breaks session state and, before
1.21, prepared statements: the one the tests must survive.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outboxkit.errors import EmbeddedServerUnavailable
from outboxkit.testing import free_port, port_accepts
from outboxkit.testing._process import ServerProcess

#: Where Debian installs the binary (``apt-get install pgbouncer``).
PGBOUNCER_CANDIDATES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")
INSTALL_HINT = "install Debian's package: `apt-get install -y pgbouncer`"


def find_pgbouncer() -> str:
    """The pgbouncer binary, or EmbeddedServerUnavailable saying how to install it."""
    for candidate in (shutil.which("pgbouncer"), *PGBOUNCER_CANDIDATES):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EmbeddedServerUnavailable(f"pgbouncer is not installed; {INSTALL_HINT}")


def pgbouncer_version(binary: str) -> tuple[int, ...]:
    """(1, 18, 0) from ``pgbouncer --version``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    words = out.stdout.split()
    try:
        return tuple(int(p) for p in words[words.index("PgBouncer") + 1].split("."))
    except (ValueError, IndexError):
        return (0,)


class PgBouncer(ServerProcess):
    """``pgbouncer`` in ``pool_mode`` (transaction by default) in front of ``target_dsn``.

    ``dsn_for(db)`` is a DSN through the pooler; ``max_prepared_statements`` is written to
    the config only when given (PgBouncer 1.21+ knows it; 1.18 does not).
    """

    _name = "pgbouncer"
    _start_timeout = 15.0

    def __init__(
        self,
        target_dsn: str,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 10,
        max_prepared_statements: int | None = None,
    ) -> None:
        super().__init__()
        self.binary = find_pgbouncer()
        self.version = pgbouncer_version(self.binary)
        target = conninfo_to_dict(target_dsn)
        self._user = str(target.get("user") or "postgres")
        self._password = str(target.get("password") or "")
        self._host = str(target.get("host") or "127.0.0.1")
        self._target_port = int(target.get("port") or 5432)
        self.port = free_port()
        self.pool_mode = pool_mode
        self._dir = Path(tempfile.mkdtemp(prefix="outboxkit-pgbouncer-"))
        self._dir.chmod(0o755)  # read by the unprivileged user pgbouncer runs as under root
        self._config = self._dir / "pgbouncer.ini"
        server = f"host={self._host} port={self._target_port} user={self._user}"
        if self._password:
            server += f" password={self._password}"
        lines = [
            "[databases]",
            f"* = {server}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self._dir / 'userlist.txt'}",
            f"admin_users = {self._user}",
            f"pool_mode = {pool_mode}",
            f"default_pool_size = {pool_size}",
            "max_client_conn = 500",
            "ignore_startup_parameters = extra_float_digits",
            "server_login_retry = 1",
        ]
        if max_prepared_statements is not None:
            lines.append(f"max_prepared_statements = {max_prepared_statements}")
        if os.getuid() == 0:  # pgbouncer refuses to run as root
            lines.append("user = nobody")
        self._config.write_text("\n".join(lines) + "\n")
        (self._dir / "userlist.txt").write_text(f'"{self._user}" ""\n')
        for path in (self._config, self._dir / "userlist.txt"):
            path.chmod(0o644)

    def _command(self) -> list[str]:
        return [self.binary, str(self._config)]

    def _log_path(self) -> Path:
        return self._dir / "pgbouncer.log"

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        return port_accepts(self.port)

    def dsn_for(self, dbname: str) -> str:
        """A DSN of ``dbname`` through the pooler."""
        return make_conninfo(
            host="127.0.0.1", port=self.port, user=self._user, dbname=dbname, connect_timeout=10
        )

    def url_for(self, dbname: str) -> str:
        """The same as a URL (what the CLI and the README show)."""
        return f"postgresql://{self._user}@127.0.0.1:{self.port}/{dbname}"

    def close(self) -> None:
        super().close()
        shutil.rmtree(self._dir, ignore_errors=True)
