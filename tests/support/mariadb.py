"""A private MariaDB for the tests: Debian's ``mariadbd`` on a free loopback port.

Debian's ``mariadb-server`` package (10.11 on these machines) provides the binaries; the
server is a child process with its own data directory in a temporary directory, never the
machine's server on 3306. Durability settings are off (the tests crash relays, not the
database) so it initialises and starts in a few seconds.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from outboxkit.errors import EmbeddedServerUnavailable
from outboxkit.testing import free_port, port_accepts
from outboxkit.testing._process import ServerProcess

#: Where Debian installs the binaries (``apt-get install mariadb-server``).
MARIADBD_CANDIDATES = ("/usr/sbin/mariadbd", "/usr/sbin/mysqld")
INSTALL_DB_CANDIDATES = ("/usr/bin/mariadb-install-db", "/usr/bin/mysql_install_db")
INSTALL_HINT = "install Debian's package: `apt-get install -y mariadb-server`"


def _find(candidates: tuple[str, ...], name: str) -> str:
    for candidate in (shutil.which(Path(candidates[0]).name), *candidates):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EmbeddedServerUnavailable(f"{name} is not installed; {INSTALL_HINT}")


class MariaDB(ServerProcess):
    """``mariadbd`` with its own data directory on a free port; ``url_for(db)`` to reach it.

    As root it runs with ``--user=root`` (mariadbd refuses root otherwise) rather than
    switching to ``mysql``, so the temporary directory needs no ownership changes.
    Clients connect over TCP as ``root`` without a password
    (``--auth-root-authentication-method=normal``).
    """

    _name = "mariadbd"
    _start_timeout = 30.0

    def __init__(self, *options: str) -> None:
        """``options``: more server options (``--max-allowed-packet=1M``)."""
        super().__init__()
        self._extra = list(options)
        self.binary = _find(MARIADBD_CANDIDATES, "mariadbd")
        self._install_db = _find(INSTALL_DB_CANDIDATES, "mariadb-install-db")
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="outboxkit-mariadb-"))
        self._data = self._dir / "data"
        self._tmp = self._dir / "tmp"
        self._socket = self._dir / "mariadb.sock"
        self._user = pwd.getpwuid(os.getuid()).pw_name
        self._initialised = False

    def _options(self) -> list[str]:
        # A temporary directory of its own: the bootstrap's temporary tables are named
        # `/tmp/#sql-temptable-<pid>-...`, and two installs at once (pytest-xdist) could
        # collide there ("Unknown table 'mysql.tmp_user_sys'", then "Aborting": 4 of 18
        # installs six at a time failed with the shared /tmp, 0 of 18 with their own).
        return [
            "--no-defaults",
            f"--datadir={self._data}",
            f"--user={self._user}",
            f"--tmpdir={self._tmp}",
        ]

    def _command(self) -> list[str]:
        return [
            self.binary,
            *self._options(),
            "--bind-address=127.0.0.1",
            f"--port={self.port}",
            f"--socket={self._socket}",
            f"--pid-file={self._dir / 'mariadbd.pid'}",
            "--skip-name-resolve",
            "--innodb-flush-log-at-trx-commit=0",
            "--innodb-doublewrite=0",
            "--innodb-buffer-pool-size=64M",
            "--innodb-log-file-size=32M",
            "--sync-binlog=0",
            "--max-connections=500",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_bin",
            *self._extra,
        ]

    def _log_path(self) -> Path:
        return self._dir / "mariadbd.log"

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        return self._socket.exists() and port_accepts(self.port)

    def start(self) -> None:
        """Initialise the data directory once, then start and wait for clients."""
        if not self._initialised:
            self._data.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(parents=True, exist_ok=True)
            done = self._run(
                [
                    self._install_db,
                    *self._options(),
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                    "--skip-name-resolve",
                ]
            )
            if done.returncode != 0:
                lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
                # The server's own [ERROR] lines say why ("Aborting", the last, does not).
                why = [line for line in lines if "[ERROR]" in line][-5:] or lines[-1:]
                raise EmbeddedServerUnavailable(f"mariadb-install-db failed: {' | '.join(why)}")
            self._initialised = True
        super().start()

    def url_for(self, dbname: str) -> str:
        """A URL of ``dbname`` (what the CLI takes: ``mysql://root@127.0.0.1:PORT/db``)."""
        return f"mysql://root@127.0.0.1:{self.port}/{dbname}"

    def connect_args(self, dbname: str | None = None) -> dict[str, object]:
        """PyMySQL/aiomysql keyword arguments for ``dbname`` (or no database)."""
        args: dict[str, object] = {"host": "127.0.0.1", "port": self.port, "user": "root"}
        if dbname is not None:
            args["database"] = dbname
        return args

    def close(self) -> None:
        super().close()
        shutil.rmtree(self._dir, ignore_errors=True)
