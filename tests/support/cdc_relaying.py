"""Helpers for the CDC relay's tests: the slot and publication, a relay in this event loop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg

from outboxkit import Outbox, Publisher
from outboxkit.cdc.relay import CdcRelay
from outboxkit.testing import spawn_relay


def setup_cdc(dsn: str, table: str = "outbox") -> str:
    """Create the outbox's publication and slot (`outboxkit cdc setup`); returns the slot."""
    from outboxkit.cdc import slots

    slots.setup(dsn, table=table)
    return slots.default_name(table)


def slot_lag(dsn: str, slot: str) -> int:
    """Bytes of WAL the slot holds: pg_current_wal_lsn() - confirmed_flush_lsn."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint"
            " FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None, f"no slot {slot}"
    return int(row[0])


def slot_confirmed(dsn: str, slot: str) -> int:
    """The slot's confirmed_flush_lsn as a number (the position the server resumes from)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots"
            " WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    assert row is not None, f"no slot {slot}"
    return int(row[0])


def slot_active(dsn: str, slot: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return bool(row and row[0])


@contextlib.asynccontextmanager
async def running_cdc_relay(
    dsn: str, publisher: Publisher, **options: Any
) -> AsyncIterator[CdcRelay]:
    """A CdcRelay running in this event loop for the duration of the block."""
    defaults: dict[str, Any] = {"retry_base": 0.05, "retry_cap": 0.5, "cleanup_interval": 0.5}
    relay = CdcRelay(dsn, publisher, **{**defaults, **options})
    task = asyncio.create_task(relay.run())
    try:
        yield relay
    finally:
        relay.stop()
        await asyncio.wait_for(task, timeout=30)


def write_wal(
    dsn: str, events: list[Any], *, rollback: bool = False, table: str = "outbox"
) -> None:
    """WAL-only events (``Outbox(storage="wal")``: logical messages, no row), one transaction."""
    with psycopg.connect(dsn) as conn:
        Outbox(table, storage="wal").put_many(conn, events)
        if rollback:
            conn.rollback()
        else:
            conn.commit()


class RelayProcess:
    """`outboxkit relay --source cdc` as a real process (to SIGKILL), started by the library's
    `spawn_relay` (the DSN travels in its environment, not in argv); its log in a file."""

    def __init__(self, dsn: str, broker: str, *extra: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="outboxkit-cdc-relay-")  # gone with self
        self.log_path = Path(self._dir.name) / "relay.log"
        args = ["--source", "cdc", "--retry-base", "0.05", "--retry-cap", "0.5", *extra]
        self.proc = spawn_relay(dsn, broker, self.log_path, *args, log_level=None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def lines(self) -> list[str]:
        return self.output.splitlines(keepends=True)

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident set (VmHWM), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")
