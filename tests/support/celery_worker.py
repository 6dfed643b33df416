"""A real ``celery worker`` process (tests/support/celery_app.py) and what its tasks recorded."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika

from outboxkit import Event
from outboxkit.publishers.base import OutboundMessage
from tests.support.servers import require_or_skip

ROOT = Path(__file__).resolve().parents[2]


def celery_env(broker: str, queue: str, record: Path, backend: str | None = None) -> dict[str, str]:
    """The environment the test app reads: broker, queue, result backend, record file."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.update(
        OUTBOXKIT_CELERY_BROKER=broker,
        OUTBOXKIT_CELERY_QUEUE=queue,
        OUTBOXKIT_CELERY_RECORD=str(record),
        OUTBOXKIT_CELERY_BACKEND=backend or "",
    )
    return env


@contextlib.contextmanager
def celery_worker(
    broker: str, queue: str, record: Path, *, backend: str | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``celery -A tests.support.celery_app worker -P solo -Q queue``, ready when yielded."""
    try:
        import celery  # noqa: F401
    except ImportError:
        require_or_skip("celery is not installed (pip install -e '.[dev]')")
    log_path = record.with_suffix(".worker.log")
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.support.celery_app",
        "worker",
        "-P",
        "solo",
        "-Q",
        queue,
        "-n",
        f"{queue}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "info",
    ]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd, env=celery_env(broker, queue, record, backend), stdout=log, stderr=log, cwd=ROOT
        )
    try:
        deadline = time.monotonic() + 60
        while b" ready." not in log_path.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"celery worker did not start: {log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            # Cold shutdown (SIGQUIT), then SIGKILL: the runs are recorded by now, and
            # the AMQP consumer can take ten seconds to wind down.
            proc.send_signal(signal.SIGQUIT)
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def runs(record: Path) -> list[dict[str, Any]]:
    """Every run the worker recorded (one per execution: duplicates show)."""
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]


def wait_for_runs(
    record: Path, predicate: Any, *, timeout: float, what: str
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        done = runs(record)
        if predicate(done):
            return done
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what}: {len(done)} runs"
            )
        time.sleep(0.1)


def delete_amqp_queue(url: str, queue: str) -> None:
    """Remove a test's queue and its exchange from the machine's RabbitMQ."""

    async def delete() -> None:
        connection = await aio_pika.connect(url)
        try:
            channel = await connection.channel()
            await channel.queue_delete(queue)
            await channel.exchange_delete(queue)
        finally:
            await connection.close()

    with contextlib.suppress(Exception):
        asyncio.run(delete())


def as_outbound(event: Event) -> OutboundMessage:
    """The message the relay would hand a publisher for ``event`` (claimed just now)."""
    return OutboundMessage(
        event.event_id,
        event.topic,
        event.key,
        event.event_type,
        event.aggregate_type,
        event.aggregate_id,
        event.payload,
        dict(event.headers),
        dt.datetime.now(dt.UTC),
    )
