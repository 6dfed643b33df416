"""Helpers for the CDC relay's tests: the slot and publication, a relay in this event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg

from outboxkit import Publisher
from outboxkit.cdc.relay import CdcRelay


def setup_cdc(dsn: str, table: str = "outbox") -> str:
    """Create the outbox's publication and slot (as `outboxkit cdc setup`); returns the slot."""
    name = "outboxkit_" + table.replace(".", "_")
    try:
        from outboxkit.cdc import slots

        slots.setup(dsn, table=table)  # type: ignore[attr-defined]
        return name
    except (ImportError, AttributeError):
        pass
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE PUBLICATION {name} FOR TABLE {table} WITH (publish = 'insert')")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))
    return name


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
