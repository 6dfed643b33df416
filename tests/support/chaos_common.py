"""What the chaos runs share (tests/support/chaos.py and ordered_chaos.py).

Writer and relay processes, the fault loop while the writers run, the healing and the
draining afterwards, the rolled-back ids the writers recorded, and a JetStream stream
created and read back from the start.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

from tests.support.chaos_sql import cursor

REPO = Path(__file__).resolve().parents[2]

Relays = list[subprocess.Popen[bytes] | None]


class ChaosReportBase:
    """``violations()`` and ``to_json()`` of a chaos report (a dataclass)."""

    CHECKED: ClassVar[tuple[str, ...]] = ()  # the counters that must stay 0

    def violations(self) -> list[str]:
        checks = {name: getattr(self, name) for name in self.CHECKED}
        return [f"{k}={v}" for k, v in checks.items() if v]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)  # type: ignore[call-overload]


def start_writers(
    module: str, count: int, args: Callable[[int], list[str]]
) -> list[subprocess.Popen[bytes]]:
    """``count`` writer processes ``python -m module *args(w)``, output captured."""
    procs = []
    for w in range(count):
        cmd = [sys.executable, "-m", module, *args(w)]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
        )
    return procs


def next_fault(
    deck: list[str], kinds: Sequence[str], rng: random.Random, counts: dict[str, int]
) -> str:
    """The next fault: every kind once per round, in a random order; counted."""
    if not deck:
        deck.extend(kinds)
        rng.shuffle(deck)
    kind = deck.pop()
    counts[kind] = counts.get(kind, 0) + 1
    return kind


def restart_relay(relays: Relays, i: int, rng: random.Random, spawn: Callable[[int], None]) -> None:
    """SIGKILL relay ``i``, wait a moment, start it again."""
    proc = relays[i]
    if proc is not None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    time.sleep(rng.uniform(0.2, 1.5))
    spawn(i)


def fault_while_writing(
    writers: list[subprocess.Popen[bytes]],
    rng: random.Random,
    fault: Callable[[], None],
    pause: tuple[float, float],
    output: list[str],
) -> float:
    """A fault every ``pause`` seconds (at random) until the writers exit; then their
    output into ``output``, an AssertionError if one failed. Returns the writing time."""
    started = time.monotonic()
    while any(w.poll() is None for w in writers):
        time.sleep(rng.uniform(*pause))
        if any(w.poll() is None for w in writers):
            fault()
    writing = time.monotonic() - started
    for w in writers:
        out = w.stdout.read().decode() if w.stdout else ""
        output.append(out.strip())
        if w.returncode != 0:
            raise AssertionError(f"a writer failed (exit {w.returncode}):\n{out}")
    return writing


def respawn_exited(relays: Relays, spawn: Callable[[int], None]) -> None:
    for i, proc in enumerate(relays):
        if proc is None or proc.poll() is not None:
            spawn(i)


def kill_relays(relays: Relays) -> None:
    for proc in relays:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_relays(relays: Relays) -> None:
    """SIGTERM every relay; each must exit 0."""
    for proc in relays:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
    for proc in relays:
        if proc is not None and proc.wait(timeout=30) != 0:
            raise AssertionError(f"a relay exited {proc.returncode} on SIGTERM")


def wait_drained(dsn: str, timeout: float, interval: float, failure: Callable[[Any], str]) -> float:
    """Wait until the outbox has no pending row; returns the seconds it took. Past
    ``timeout``, an AssertionError saying ``failure(row)`` (row: the pending count's row)."""
    start = time.monotonic()
    with cursor(dsn) as cur:  # (PostgreSQL or MariaDB)
        while True:
            cur.execute("SELECT count(*) FROM outbox WHERE status = 0")
            row = cur.fetchone()
            if row is not None and row[0] == 0:
                break
            if time.monotonic() - start > timeout:
                raise AssertionError(failure(row))
            time.sleep(interval)
    return round(time.monotonic() - start, 1)


def read_rolled_back(workdir: Path) -> set[str]:
    """The event ids of the transactions the writers rolled back (rolled_back.*.txt)."""
    rolled_back: set[str] = set()
    for path in workdir.glob("rolled_back.*.txt"):
        rolled_back.update(line for line in path.read_text().split() if line)
    return rolled_back


async def create_stream(url: str, stream: str, subjects: list[str]) -> None:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        await nc.jetstream().add_stream(
            StreamConfig(
                name=stream,
                subjects=subjects,
                storage=StorageType.FILE,
                duplicate_window=900.0,  # longer than any run: every re-publish is absorbed
            )
        )
    finally:
        await nc.close()


async def read_stream(
    url: str, stream: str, subject: str, *, batch: int, seconds: float
) -> list[dict[str, str]]:
    """The headers of every message of ``stream``, in stream order."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream()
        total = (await js.stream_info(stream)).state.messages
        sub = await js.pull_subscribe(
            subject,
            stream=stream,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE),
        )
        got: list[dict[str, str]] = []
        deadline = time.monotonic() + seconds
        while len(got) < total and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
                for msg in await sub.fetch(min(batch, total - len(got)), timeout=2):
                    got.append(msg.headers or {})
        await sub.unsubscribe()
        return got
    finally:
        await nc.close()
