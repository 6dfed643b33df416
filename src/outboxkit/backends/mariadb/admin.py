"""Operator functions on a MariaDB/MySQL outbox: status, dead letters, replay, purge, gauges.

The same functions, arguments and results as PostgreSQL's (outboxkit.backends.postgres.admin), so
the CLI, the dashboard and the metrics take either through outboxkit.admin.admin_for(dsn). Each
takes a URL (a connection of its own, closed after) or an open PyMySQL connection (the dashboard's
kept ones), and runs in autocommit: every statement sees what was committed before it, whatever the
isolation level."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from outboxkit.backends.mariadb import sql
from outboxkit.backends.mariadb.admin_sql import (
    MYSQL_LIVE_TABLE_STATS,
    AdminStatements,
    InboxAdminStatements,
)
from outboxkit.backends.mariadb.migrate import connect as _connect_url
from outboxkit.errors import SchemaError, StoreError, StoreUnavailable, table_missing
from outboxkit.maintenance.purge import in_batches
from outboxkit.maintenance.report import (
    EventRef,
    LiveStatus,
    OutboxStatus,
    TopicStatus,
    add_counts,
    live_report,
    parse_event_ref,
    status_name,
)

#: A MariaDB URL (``mysql://`` or ``mariadb://``) or an open PyMySQL connection.
Source = Any
_NO_TABLE = 1146
_MICROS = 1_000_000


def connect(dsn: str) -> Any:
    """An autocommit PyMySQL connection (the dashboard keeps a few); a server that stops
    answering fails its statement after a minute instead of hanging the page or gauges."""
    conn = _connect_url(dsn, autocommit=True, read_timeout=60, write_timeout=60)
    if "mariadb" not in conn.get_server_info().lower():  # MySQL (untested here: no server)
        with conn.cursor() as cur:
            cur.execute(MYSQL_LIVE_TABLE_STATS)
    return conn


def usable(conn: Any) -> bool:
    """Whether a kept connection may be used again (not closed by us or by the server)."""
    return bool(conn.open)


def connection_lost() -> tuple[type[BaseException], ...]:
    """The errors that mean a kept connection died (try once more on a new one): the
    functions here say it as StoreUnavailable; PyMySQL's own errors for the rest."""
    try:
        import pymysql
    except ImportError:  # pragma: no cover - the extra is missing: connect() says so
        return (StoreUnavailable,)
    return (StoreUnavailable, pymysql.err.OperationalError, pymysql.err.InterfaceError)


@contextmanager
def _connection(source: Source, missing: Callable[[], Exception]) -> Iterator[Any]:
    """``source`` itself if it is a connection (left open), else a new one closed after.

    A statement that finds no table raises ``missing()`` (which migration creates it); a
    lost server, StoreUnavailable; any other server error, StoreError with its reason.
    """
    import pymysql

    conn = connect(source) if isinstance(source, str) else source
    try:
        yield conn
    except pymysql.err.MySQLError as exc:
        code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        if code == _NO_TABLE:
            raise missing() from None
        reason = exc.args[-1] if exc.args else type(exc).__name__
        if isinstance(exc, pymysql.err.OperationalError) and (code is None or code >= 2000):
            raise StoreUnavailable(
                f"lost the MariaDB connection: {reason} — check --dsn and that the server is up",
                cause=exc,
            ) from None
        raise StoreError(f"MariaDB: {reason}", cause=exc) from None
    finally:
        if isinstance(source, str):
            conn.close()


def _outbox(source: Source, table: str) -> Any:
    return _connection(source, lambda: table_missing(table, database=_database(source)))


def _database(source: Source) -> str | None:
    if isinstance(source, str):
        return str(sql.connect_args(source)["database"])
    db = getattr(source, "db", None)
    return db.decode() if isinstance(db, bytes) else db


def _utc(value: Any) -> Any:
    """MariaDB's naive UTC DATETIME as an aware one (as PostgreSQL's timestamptz reads)."""
    return value.replace(tzinfo=dt.UTC) if isinstance(value, dt.datetime) else value


def _row(names: list[str], values: tuple[Any, ...]) -> dict[str, Any]:
    """A row as PostgreSQL's admin returns it: UUIDs, aware times, headers as a dict."""
    row = dict(zip(names, values, strict=True))
    for name in ("event_id", "claim_token"):
        if isinstance(row.get(name), str):
            row[name] = uuid.UUID(row[name])
    if isinstance(row.get("headers"), str):
        row["headers"] = orjson.loads(row["headers"])
    return {k: _utc(v) for k, v in row.items()}


def _fetch_dicts(cur: Any) -> list[dict[str, Any]]:
    names = [d[0] for d in cur.description or ()]
    return [_row(names, r) for r in cur.fetchall()]


def _topic_status(row: tuple[Any, ...]) -> TopicStatus:
    topic, pending, in_flight, failed, published, age = row
    return TopicStatus(
        str(topic),
        int(pending or 0),
        int(in_flight or 0),
        int(failed or 0),
        int(published or 0),
        None if age is None else max(0.0, float(age)),
    )


def status(dsn: Source, table: str = "outbox") -> OutboxStatus:
    """Counts per state and topic, and the age of the oldest pending event."""
    stmts = AdminStatements(table)
    report = OutboxStatus(table=table)
    with _outbox(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(stmts.status_by_topic)
        for row in cur.fetchall():
            t = _topic_status(row)
            report.topics.append(t)
            add_counts(report, t)
    return report


def list_failed(
    dsn: Source, table: str = "outbox", *, topic: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Dead-lettered events, oldest first, without their payloads."""
    stmts = AdminStatements(table)
    with _outbox(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(stmts.list_failed, (topic, topic, limit))
        return _fetch_dicts(cur)


def get_event(dsn: Source, ref: str, table: str = "outbox") -> dict[str, Any] | None:
    """One event by outbox row id or by event id (UUID)."""
    stmts = AdminStatements(table)
    key = parse_event_ref(ref)
    with _outbox(dsn, table) as conn, conn.cursor() as cur:
        if isinstance(key, int):
            cur.execute(stmts.show_event, (key,))
        else:
            cur.execute(stmts.show_event_by_event_id, (str(key),))
        rows = _fetch_dicts(cur)
    if not rows:
        return None
    rows[0]["status"] = status_name(rows[0]["status"])
    return rows[0]


def list_events(dsn: Source, table: str = "outbox") -> list[dict[str, Any]]:
    """Every event of the table with every column, in write order (the testing kit reads it)."""
    with _outbox(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(AdminStatements(table).list_events)
        rows = _fetch_dicts(cur)
    for row in rows:
        row["status"] = status_name(row["status"])
    return rows


def _row_ids(cur: Any, stmts: AdminStatements, refs: list[EventRef]) -> list[int]:
    """The row ids of ``refs``: row ids as given, event ids looked up (unknown ones dropped)."""
    ids = [ref for ref in refs if isinstance(ref, int)]
    for ref in refs:
        if isinstance(ref, uuid.UUID):
            cur.execute(stmts.row_id_by_event_id, (str(ref),))
            ids.extend(int(r[0]) for r in cur.fetchall())
    return ids


def replay(
    dsn: Source,
    table: str = "outbox",
    *,
    ids: list[EventRef] | None = None,
    topic: str | None = None,
    all_failed: bool = False,
) -> int:
    """Put dead-lettered events back in line with a fresh attempt budget; returns the count."""
    stmts = AdminStatements(table)
    with _outbox(dsn, table) as conn, conn.cursor() as cur:
        if ids:
            rows = _row_ids(cur, stmts, ids)
            if not rows:
                return 0
            return int(cur.execute(sql.with_ids(stmts.replay_by_id, len(rows)), rows))
        if topic is not None:
            return int(cur.execute(stmts.replay_by_topic, (topic,)))
        if all_failed:
            return int(cur.execute(stmts.replay_all_failed))
    raise ValueError("say what to replay: ids, a topic, or all_failed=True")


def discard(
    dsn: Source,
    table: str = "outbox",
    *,
    ids: list[EventRef] | None = None,
    topic: str | None = None,
    all_failed: bool = False,
    batch_size: int = 1000,
) -> int:
    """Delete dead-lettered events for good; rows not in status failed are left alone.

    A topic's or all failed events go in batches of ``batch_size``, each its own statement.
    """
    if sum(bool(x) for x in (ids, topic is not None, all_failed)) != 1:
        raise ValueError("say what to discard: ids, a topic, or all_failed=True")
    stmts = AdminStatements(table)
    with _outbox(dsn, table) as conn, conn.cursor() as cur:

        def delete(rows: list[int]) -> int:
            return int(cur.execute(sql.with_ids(stmts.discard_failed_by_id, len(rows)), rows))

        if ids:
            rows = _row_ids(cur, stmts, ids)
            return delete(rows) if rows else 0

        def one_batch() -> int:
            cur.execute(stmts.list_failed, (topic, topic, batch_size))
            batch = [int(r[0]) for r in cur.fetchall()]
            return delete(batch) if batch else 0

        return in_batches(one_batch, batch_size=batch_size)


def purge(
    dsn: Source,
    table: str = "outbox",
    *,
    older_than: dt.timedelta,
    batch_size: int = 1000,
    pause: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete published rows (retention keep) older than ``older_than``, in small batches."""
    stmts = AdminStatements(table)
    params = (round(older_than.total_seconds() * _MICROS), batch_size)
    with _outbox(dsn, table) as conn, conn.cursor() as cur:
        return in_batches(
            lambda: int(cur.execute(stmts.purge_published_batch, params)),
            batch_size=batch_size,
            pause=pause,
            progress=progress,
        )


def count_purgeable(dsn: Source, table: str, older_than: dt.timedelta) -> int:
    """How many published rows a purge would delete (for a progress bar)."""
    stmts = AdminStatements(table)
    with _outbox(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(stmts.count_purgeable, (round(older_than.total_seconds() * _MICROS),))
        row = cur.fetchone()
    return int(row[0]) if row else 0


def _last_id(cur: Any, stmts: AdminStatements, table: str) -> int:
    database, _, bare = table.rpartition(".")
    cur.execute(stmts.last_event_id, (database or None, bare))
    row = cur.fetchone()
    return max(0, int(row[0])) if row and row[0] is not None else 0


def last_event_id(dsn: Source, table: str = "outbox") -> int:
    """The last row id handed out: events written so far, for throughput."""
    stmts = AdminStatements(table)
    with _outbox(dsn, table) as conn, conn.cursor() as cur:
        return _last_id(cur, stmts, table)


def live_status(dsn: Source, table: str = "outbox", *, cap: int = 100_000) -> LiveStatus:
    """Pending, in-flight and failed per topic, at most ``cap`` rows each (never published
    rows, so polling it costs the same however large a ``retention=keep`` table grows)."""
    stmts = AdminStatements(table)
    with _outbox(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(stmts.metrics_pending_by_topic, (cap,))
        pending = [
            (str(topic), int(n), int(f), None if age is None else float(age))
            for topic, n, f, age in cur.fetchall()
        ]
        cur.execute(stmts.metrics_failed_by_topic, (cap,))
        failed = [(str(topic), int(n)) for topic, n in cur.fetchall()]
        last_id = _last_id(cur, stmts, table)
    return live_report(table, pending, failed, last_id, cap)


def blocked_keys(
    source: Source, *, table: str = "outbox", limit: int = 100
) -> list[dict[str, Any]]:
    """Keys stopped behind a dead-lettered head event (ordered mode, policy ``block``): the
    key, the head row and ``waiting``, the pending events behind it, as on PostgreSQL.
    Empty on a table that is not ordered (no ``partition`` column)."""
    stmts = AdminStatements(table)
    with _outbox(source, table) as conn, conn.cursor() as cur:
        cur.execute(stmts.is_ordered, (table.rsplit(".", 1)[-1],))
        if not cur.fetchone()[0]:
            return []
        cur.execute(stmts.blocked_keys, (limit,))
        return _fetch_dicts(cur)


def stray_rows(source: Source, table: str = "outbox") -> int:
    """Rows outside every time partition: 0, as MariaDB outboxes are not partitioned."""
    return 0


def _inbox(source: Source, table: str) -> Any:
    return _connection(
        source,
        lambda: SchemaError(
            f"inbox table {table!r} not found: run `outboxkit migrate --inbox"
            f" --inbox-table {table} --dsn …`"
        ),
    )


def purge_inbox(
    conninfo: Source,
    *,
    older_than: dt.timedelta,
    table: str = "processed_events",
    consumer: str | None = None,
    batch_size: int = 1000,
    pause: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete inbox records older than ``older_than`` in short statements; returns the count."""
    stmts = InboxAdminStatements(table)
    params = (round(older_than.total_seconds() * _MICROS), consumer, consumer, batch_size)
    with _inbox(conninfo, table) as conn, conn.cursor() as cur:
        return in_batches(
            lambda: int(cur.execute(stmts.purge_batch, params)),
            batch_size=batch_size,
            pause=pause,
            progress=progress,
        )


def count_inbox_purgeable(
    conninfo: Source,
    *,
    older_than: dt.timedelta,
    table: str = "processed_events",
    consumer: str | None = None,
) -> int:
    """How many inbox records a purge would delete (for a progress bar)."""
    stmts = InboxAdminStatements(table)
    with _inbox(conninfo, table) as conn, conn.cursor() as cur:
        cur.execute(
            stmts.count_purgeable, (round(older_than.total_seconds() * _MICROS), consumer, consumer)
        )
        row = cur.fetchone()
    return int(row[0]) if row else 0
