"""Operator queries on an outbox table: status, dead letters, replay, purge (PostgreSQL).

MariaDB's are in backends/mariadb/admin.py; outboxkit.admin.admin_for(dsn) picks one.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outboxkit.backends.postgres._connection import Source, admin_connection
from outboxkit.backends.postgres.cdc_sql import CdcRelayStatements
from outboxkit.backends.postgres.postgres import DEFAULT_TABLE, Statements, Status
from outboxkit.errors import table_missing
from outboxkit.maintenance.purge import in_batches
from outboxkit.maintenance.report import (
    EventRef,
    LiveStatus,
    OutboxStatus,
    TopicStatus,
    live_report,
    parse_event_ref,
)
from outboxkit.maintenance.report import add_counts as _add_counts


def _connect(dsn: Source, table: str) -> AbstractContextManager[psycopg.Connection[Any]]:
    return admin_connection(dsn, lambda: table_missing(table))


def status(dsn: str, table: str = DEFAULT_TABLE) -> OutboxStatus:
    """Counts per state and topic, and the age of the oldest pending event."""
    sql = Statements(table)
    report = OutboxStatus(table=table)
    with _connect(dsn, table) as conn:
        for row in conn.execute(sql.status_by_topic).fetchall():
            t = TopicStatus(*row)
            report.topics.append(t)
            _add_counts(report, t)
    return report


def list_failed(
    dsn: Source, table: str = DEFAULT_TABLE, *, topic: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Dead-lettered events, oldest first, without their payloads."""
    sql = Statements(table)
    with _connect(dsn, table) as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql.list_failed, {"topic": topic, "limit": limit})
        return cur.fetchall()


def get_event(dsn: Source, ref: str, table: str = DEFAULT_TABLE) -> dict[str, Any] | None:
    """One event by outbox row id or by event id (UUID)."""
    sql = Statements(table)
    with _connect(dsn, table) as conn, conn.cursor(row_factory=dict_row) as cur:
        if ref.isdigit():
            cur.execute(sql.show_event, (int(ref),))
        else:
            try:
                event_id = uuid.UUID(ref)
            except ValueError:
                raise ValueError(f"{ref!r} is neither a row id nor an event id (UUID)") from None
            cur.execute(sql.show_event_by_event_id, (event_id,))
        row = cur.fetchone()
    if row is not None:
        row["status"] = _status_name(row["status"])
    return row


def list_events(dsn: Source, table: str = DEFAULT_TABLE) -> list[dict[str, Any]]:
    """Every event of the table with every column, in write order (the testing kit reads it)."""
    sql = Statements(table)
    with _connect(dsn, table) as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql.list_events)
        rows = cur.fetchall()
    for row in rows:
        row["status"] = _status_name(row["status"])
    return rows


def _row_ids(conn: psycopg.Connection[Any], table: str, refs: list[EventRef]) -> list[int]:
    """The row ids of ``refs``: row ids as given, event ids looked up (unknown ones dropped)."""
    sql = Statements(table)
    ids = [ref for ref in refs if isinstance(ref, int)]
    for ref in refs:
        if isinstance(ref, uuid.UUID):
            row = conn.execute(sql.show_event_by_event_id, (ref,)).fetchone()
            if row is not None:
                ids.append(int(row[0]))
    return ids


def replay(
    dsn: Source,
    table: str = DEFAULT_TABLE,
    *,
    ids: list[EventRef] | None = None,
    topic: str | None = None,
    all_failed: bool = False,
) -> int:
    """Put dead-lettered events back in line with a fresh attempt budget; returns the count.

    ``ids`` are row ids or event ids (UUIDs). A table in a publication (``outboxkit cdc
    setup``) gets its events inserted anew as pending rows (the failed ones deleted): the
    WAL relay sees inserts only, and the polling relay claims the new rows just the same.
    """
    sql = CdcRelayStatements(table)
    with _connect(dsn, table) as conn:
        if ids:
            ids = list(_row_ids(conn, table, ids))
            if not ids:
                return 0
        row = conn.execute(sql.cdc_is_published, (sql.qualified,)).fetchone()
        if row is not None and row[0]:
            stmts = (sql.cdc_replay_by_id, sql.cdc_replay_by_topic, sql.cdc_replay_all_failed)
        else:
            stmts = (sql.replay_by_id, sql.replay_by_topic, sql.replay_all_failed)
        if ids:
            cur = conn.execute(stmts[0], (ids,))
        elif topic is not None:
            cur = conn.execute(stmts[1], (topic,))
        elif all_failed:
            cur = conn.execute(stmts[2])
        else:
            raise ValueError("say what to replay: ids, a topic, or all_failed=True")
        return cur.rowcount


def purge(
    dsn: str,
    table: str = DEFAULT_TABLE,
    *,
    older_than: dt.timedelta,
    batch_size: int = 1000,
    pause: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete published rows (keep mode) older than ``older_than``, in small batches.

    Each batch is its own short transaction, so purging years of history never
    holds a long lock or builds one huge vacuum debt.
    """
    sql = Statements(table)
    params = (older_than.total_seconds(), batch_size)
    with _connect(dsn, table) as conn:
        return in_batches(
            lambda: conn.execute(sql.purge_published_batch, params).rowcount,
            batch_size=batch_size,
            pause=pause,
            progress=progress,
        )


def count_purgeable(dsn: str, table: str, older_than: dt.timedelta) -> int:
    """How many published rows a purge would delete (for a progress bar)."""
    sql = Statements(table)
    with _connect(dsn, table) as conn:
        row = conn.execute(sql.count_purgeable, (older_than.total_seconds(),)).fetchone()
    return int(row[0]) if row else 0


def discard(
    dsn: Source,
    table: str = DEFAULT_TABLE,
    *,
    ids: list[EventRef] | None = None,
    topic: str | None = None,
    all_failed: bool = False,
    batch_size: int = 1000,
) -> int:
    """Delete dead-lettered events for good; rows not in status failed are left alone.

    By row or event ids, every failed event of a topic, or every failed event; a topic's or
    all of them go in batches of ``batch_size``, each its own short transaction.
    """
    if sum(bool(x) for x in (ids, topic is not None, all_failed)) != 1:
        raise ValueError("say what to discard: ids, a topic, or all_failed=True")
    sql = Statements(table)
    with _connect(dsn, table) as conn:
        if ids:
            return conn.execute(sql.discard_failed_by_id, (_row_ids(conn, table, ids),)).rowcount

        def one_batch() -> int:
            rows = conn.execute(sql.list_failed, {"topic": topic, "limit": batch_size})
            batch = [int(row[0]) for row in rows.fetchall()]
            return conn.execute(sql.discard_failed_by_id, (batch,)).rowcount if batch else 0

        return in_batches(one_batch, batch_size=batch_size, pause=0.0, progress=None)


def last_event_id(dsn: str, table: str = DEFAULT_TABLE) -> int:
    """The last row id handed out (identity sequence): events written so far, for throughput."""
    sql = Statements(table)
    with _connect(dsn, table) as conn:
        row = conn.execute(sql.last_event_id, (sql.qualified,)).fetchone()
    return int(row[0]) if row else 0


def live_status(dsn: Source, table: str = DEFAULT_TABLE, *, cap: int = 100_000) -> LiveStatus:
    """Pending, in-flight and failed per topic from the partial indexes, at most ``cap`` rows each.

    Unlike :func:`status` it never counts published rows, so polling it every
    few seconds costs the same however large a ``retention=keep`` table grows.
    """
    sql = Statements(table)
    with _connect(dsn, table) as conn:
        pending = conn.execute(sql.metrics_pending_by_topic, {"cap": cap}).fetchall()
        failed = conn.execute(sql.metrics_failed_by_topic, {"cap": cap}).fetchall()
        max_row = conn.execute(sql.last_event_id, (sql.qualified,)).fetchone()
    return live_report(table, pending, failed, int(max_row[0]) if max_row else 0, cap)


def _status_name(value: int) -> str:
    """``failed`` for 2: how `outboxkit failed show` prints a row's state."""
    try:
        return Status(value).name.lower()
    except ValueError:  # a value written by hand or by a newer release
        return str(value)


__all__ = [
    "EventRef",
    "LiveStatus",
    "OutboxStatus",
    "TopicStatus",
    "count_purgeable",
    "discard",
    "get_event",
    "last_event_id",
    "list_events",
    "list_failed",
    "live_status",
    "parse_event_ref",
    "purge",
    "replay",
    "status",
]
