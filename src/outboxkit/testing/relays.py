"""`outboxkit relay` as a real OS process, so a test, benchmark or the demo can kill it."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path


def spawn_relay(
    dsn: str,
    broker: str,
    log_path: Path,
    *args: str,
    log_level: str | None = "debug",
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    open_files: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start `outboxkit relay ARGS` with its output appended to `log_path`; return the process.

    The DSN and broker URL travel in the environment (`OUTBOXKIT_DSN`, `OUTBOXKIT_BROKER`),
    never in argv, so a password in them does not show in `ps`. Other `OUTBOXKIT_*` variables
    of this process are not inherited (a user's `OUTBOXKIT_TABLE` would point the relay at
    another table), except `OUTBOXKIT_TEST_*`, which tests use for secrets; `env` adds to that.
    `log_level` defaults to debug, the level a failing test wants to read; None keeps the
    relay's default. `open_files` caps the relay's open-file limit (soft and hard).
    """
    child_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OUTBOXKIT_") or k.startswith("OUTBOXKIT_TEST_")
    }
    child_env |= {"OUTBOXKIT_DSN": dsn, "OUTBOXKIT_BROKER": broker, **(env or {})}
    level = [] if log_level is None else ["--log-level", log_level]
    command = [sys.executable, "-m", "outboxkit", "relay", *level, *args]  # args win
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=cwd,
            preexec_fn=None if open_files is None else _limit_open_files(open_files),
        )


def _limit_open_files(limit: int) -> Callable[[], None]:
    def limit_in_child() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return limit_in_child
