"""The relay's side task for a partitioned outbox: partitions ahead, expired ones dropped.

Every relay of a partitioned table runs it (a plain table ends it at once); the table's
maintenance lock (store/partitions.py) lets one run at a time, the others skip. It runs at
start and every :data:`INTERVAL` seconds, with the settings ``migrate --partition-by``
stored. A failed run (database down, a lock not obtained) is logged and retried at the
next one: a missed run costs nothing while partitions exist ahead (3 periods by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from outboxkit._text import first_line
from outboxkit.errors import OutboxkitError
from outboxkit.store.partitions import MaintenanceReport, is_partitioned, maintain

log = logging.getLogger("outboxkit.relay.partitions")

#: Seconds between two maintenance runs of one relay.
INTERVAL = 300.0
APPLICATION_NAME = "outboxkit-relay:partitions"
_T = TypeVar("_T")


async def partition_maintenance(dsn: str, table: str, stopping: asyncio.Event) -> None:
    """Maintain ``table``'s partitions until ``stopping`` is set; return at once if plain."""
    try:
        partitioned = await _in_thread(_partitioned, dsn, table)
    except (psycopg.Error, OutboxkitError) as exc:
        partitioned = True  # find out at the first run
        log.debug("partition check deferred: %s", first_line(exc))
    if not partitioned:
        return
    while not stopping.is_set():
        try:
            report = await _in_thread(_maintain, dsn, table)
        except (psycopg.Error, OutboxkitError) as exc:
            log.warning(
                "partition maintenance of %s failed (%s); retrying later", table, first_line(exc)
            )
        else:
            _log(report)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=INTERVAL)


async def _in_thread(fn: Callable[[str, str], _T], dsn: str, table: str) -> _T:
    """``fn`` in a thread; a cancelled relay still waits for it (its connection closes
    before the relay's run() returns; each lock it waits for is bounded by lock_timeout)."""
    future = asyncio.get_running_loop().run_in_executor(None, fn, dsn, table)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await future
        raise


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(
        dsn, autocommit=True, connect_timeout=10, application_name=APPLICATION_NAME
    )


def _partitioned(dsn: str, table: str) -> bool:
    with _connect(dsn) as conn:
        return bool(is_partitioned(conn, table))


def _maintain(dsn: str, table: str) -> MaintenanceReport:
    with _connect(dsn) as conn:
        return maintain(conn, table)


def _log(report: MaintenanceReport) -> None:
    if report.skipped:
        log.debug("partition maintenance of %s skipped: %s", report.table, report.skipped)
        return
    if report.created or report.dropped:
        log.info(
            "partitions of %s: created %s; dropped %s",
            report.table,
            ", ".join(report.created) or "none",
            ", ".join(report.dropped) or "none",
        )
    if report.moved_rows:
        log.warning(
            "moved %d row(s) of %s from its default partition into their own partitions",
            report.moved_rows,
            report.table,
        )
    for kept in report.kept:
        log.warning("expired partition %s kept: %s", kept.name, kept.reason)
    if report.stray_rows:
        log.warning(
            "%d row(s) of %s are in its default partition: no partition covers their created_at",
            report.stray_rows,
            report.table,
        )
    if report.deferred:
        log.info("partition changes deferred (lock busy): %s", ", ".join(report.deferred))
