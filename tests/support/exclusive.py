"""Run `@pytest.mark.exclusive` tests alone while the suite runs on several xdist workers.

`make test` runs the suite on two workers (pytest-xdist) for its time budget. A few tests
drive the machine's CPUs themselves (chaos runs with killed relays, the README run top to
bottom, a slow-loris flood): beside another test they would starve its timing, and be
starved. An exclusive test waits until no other test runs and holds the others off until it
ends; the rest run side by side.

The workers are processes, so the lock is a file lock (`fcntl.flock`): ordinary tests hold it
shared, an exclusive one holds it exclusively. A turnstile in front keeps a waiting exclusive
test from starving behind a stream of shared holders: it holds the turnstile while it waits,
and every test passes through the turnstile first. Hand-written because no maintained plugin
does it (xdist's `loadgroup` pins tests to one worker but still runs the others beside them).

Outside xdist (one process) nothing is locked. The wrapper is outermost (`tryfirst`), so
waiting for the lock never counts against pytest-timeout's per-test timeout.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Generator
from pathlib import Path

import pytest

MARKER = "exclusive"


def _lock_paths(config: pytest.Config) -> tuple[Path, Path] | None:
    """The run's two lock files, in the base temporary directory all workers share.

    xdist gives each worker `<run's basetemp>/<worker id>`, so the parent is the run's own
    (pytest removes it with the run's other temporary files).
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    factory: pytest.TempPathFactory = config._tmp_path_factory  # type: ignore[attr-defined]
    run_dir = factory.getbasetemp().parent
    return run_dir / "exclusive.turnstile", run_dir / "exclusive.lock"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: runs with no other test beside it under xdist (it drives the CPUs itself)",
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    paths = _lock_paths(item.config)
    if paths is None:
        return (yield)
    turnstile_path, lock_path = paths
    exclusive = item.get_closest_marker(MARKER) is not None
    with open(turnstile_path, "a") as turnstile, open(lock_path, "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
