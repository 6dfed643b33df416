"""``manage.py outboxkit_worker`` as a child process until the Tasks framework results given
are finished (each ``refresh()``ed in turn), then SIGTERM; for the Django test projects."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def run_until_finished(
    argv: list[str], results: list[Any], log: Path, *, timeout: float = 60.0, **popen: Any
) -> int:
    """Run ``argv`` (its output in ``log``) until every result is finished or it exits,
    at most ``timeout`` seconds; its exit code after SIGTERM."""
    with log.open("wb") as stdout:
        worker = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT, **popen)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and worker.poll() is None:
            for r in results:
                r.refresh()
            if all(r.is_finished for r in results):
                break
            time.sleep(0.1)
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
    return code
