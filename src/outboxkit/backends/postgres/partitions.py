"""Time partitions of an outbox table, the PostgreSQL side: read them, create, drop, move rows.

A partitioned outbox (``outboxkit migrate --partition-by day|hour``) keeps published rows
(``retention="keep"``) and gets rid of them a whole partition at a time: ``DROP TABLE`` of a
day costs the same whether it held ten rows or ten million, leaves nothing to vacuum, and
the hot partition stays small. What to create and what to drop is decided in
maintenance/partitions.py; :func:`maintain` runs it, from the relay (maintenance/side_task.py)
and from ``outboxkit partitions maintain`` (cron), one at a time per table (a session
advisory lock). An expired partition still holding a pending or a failed row is kept
(checked through the partial indexes: the cost follows those rows, never the table).

Dropping and creating take a short ACCESS EXCLUSIVE lock on the outbox table (writers wait
milliseconds); each waits at most ``lock_timeout`` and is retried at the next run.
"""

from __future__ import annotations

import datetime as dt
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from outboxkit.backends.postgres import partitions_sql as q
from outboxkit.backends.postgres._connection import Source, admin_connection, connect
from outboxkit.backends.postgres.postgres import DEFAULT_TABLE, Statements, parse_table
from outboxkit.errors import OutboxkitError, SchemaError, table_missing
from outboxkit.maintenance.partitions import (
    DEFAULT_AHEAD,
    DEFAULT_KEEP,
    DEFAULT_LOCK_TIMEOUT,
    PERIODS,
    KeptPartition,
    MaintenanceReport,
    PartitionBy,
    PartitionSettings,
    blocks_drop,
    check_partition_by,
    default_partition_name,
    drop_horizon,
    has_expired,
    partition_name,
    period_start,
    periods_to_create,
)

__all__ = [  # the decisions' vocabulary, as callers of this module have always imported it
    "DEFAULT_AHEAD",
    "DEFAULT_KEEP",
    "DEFAULT_LOCK_TIMEOUT",
    "PERIODS",
    "KeptPartition",
    "MaintenanceReport",
    "PartitionBy",
    "PartitionChore",
    "PartitionInfo",
    "PartitionSettings",
    "check_partition_by",
    "default_partition_name",
    "drop_expired",
    "drop_published_partitions",
    "ensure_partitions",
    "finish_migration",
    "is_partitioned",
    "list_partitions",
    "maintain",
    "partition_name",
    "partitioned_script",
    "period_start",
    "prepare_migration",
    "read_settings",
    "stray_rows",
    "update_settings",
    "write_settings",
]

#: The relay's side task's connections in pg_stat_activity.
APPLICATION_NAME = "outboxkit-relay:time-partitions"


@dataclass(slots=True)
class PartitionInfo:
    """One partition as ``outboxkit partitions list`` shows it."""

    name: str
    lower: dt.datetime | None  # None: the default partition
    upper: dt.datetime | None
    rows: int  # estimated from the planner's statistics unless counted exactly
    rows_exact: bool
    pending: int
    failed: int
    size_bytes: int

    @property
    def is_default(self) -> bool:
        return self.lower is None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["lower"] = self.lower.isoformat() if self.lower else None
        d["upper"] = self.upper.isoformat() if self.upper else None
        d["default"] = self.is_default
        return d


@dataclass(frozen=True, slots=True)
class _Names:
    table: str
    schema: str | None
    name: str
    regclass: str  # quoted, for to_regclass()
    ident: sql.Composable

    @classmethod
    def of(cls, table: str) -> _Names:
        schema, name = parse_table(table)
        stmts = Statements(table)
        return cls(table, schema, name, stmts.qualified, q.ident(schema, name))

    def child(self, name: str) -> sql.Composable:
        return q.ident(self.schema, name)


def _lock_key(table: str) -> int:
    return zlib.crc32(f"outboxkit.partitions:{table}".encode())


# -- reading -----------------------------------------------------------------------------


def is_partitioned(conn: psycopg.Connection[Any], table: str) -> bool | None:
    """True for a partitioned outbox, False for a plain one, None when there is no table."""
    row = conn.execute(q.IS_PARTITIONED, (_Names.of(table).regclass,)).fetchone()
    return None if row is None else bool(row[0])


def read_settings(conn: psycopg.Connection[Any], table: str) -> PartitionSettings | None:
    row = conn.execute(q.GET_COMMENT, (_Names.of(table).regclass,)).fetchone()
    return PartitionSettings.from_comment(row[0] if row else None)


def write_settings(conn: psycopg.Connection[Any], table: str, settings: PartitionSettings) -> None:
    names = _Names.of(table)
    conn.execute(
        q.render(q.SET_COMMENT, table=names.ident, comment=sql.Literal(settings.comment()))
    )


def update_settings(
    source: Source,
    table: str = DEFAULT_TABLE,
    *,
    keep: dt.timedelta | None = None,
    ahead: int | None = None,
) -> PartitionSettings:
    """Change the stored retention window or periods ahead; returns the settings now stored."""
    with admin_connection(source, lambda: table_missing(table)) as conn:
        settings = _settings(conn, table, keep, ahead)
        write_settings(conn, table, settings)
    return settings


def _settings(
    conn: psycopg.Connection[Any], table: str, keep: dt.timedelta | None, ahead: int | None
) -> PartitionSettings:
    """The table's stored settings with ``keep``/``ahead`` overriding them when given."""
    _require_partitioned(conn, table)
    current = read_settings(conn, table)
    if current is None:
        raise SchemaError(
            f"outbox table {table!r} is partitioned but has no outboxkit partition settings"
            " (its comment was changed?): run `outboxkit migrate --partition-by day|hour`"
            " with its granularity to record them"
        )
    return PartitionSettings(
        current.by,
        current.keep if keep is None else keep,
        current.ahead if ahead is None else ahead,
    )


def _partitions(
    conn: psycopg.Connection[Any], names: _Names
) -> list[tuple[str, str, tuple[dt.datetime, dt.datetime] | None, int, int]]:
    """(regclass, relname, bounds or None for default, estimated rows, size) per partition.

    A partition another session drops while this one lists them is still in the catalog
    snapshot, but its size reads NULL: it is gone, so it is left out."""
    with _utc(conn):
        found = conn.execute(q.LIST, (names.regclass,)).fetchall()
    return [
        (r[0], r[1], q.parse_bounds(r[2]), int(r[3]), int(r[4])) for r in found if r[4] is not None
    ]


@contextmanager
def _utc(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Read partition bounds as UTC text (pg_get_expr prints them in the session's zone)."""
    if conn.autocommit:
        with conn.transaction():
            conn.execute(q.SET_UTC)
            yield
    else:
        conn.execute(q.SET_UTC)
        yield


def list_partitions(
    source: Source, table: str = DEFAULT_TABLE, *, exact: bool = False
) -> list[PartitionInfo]:
    """Every partition of ``table`` in range order (the default partition last)."""
    names = _Names.of(table)
    with admin_connection(source, lambda: table_missing(table)) as conn:
        _require_partitioned(conn, table)
        infos = []
        for regclass, relname, bounds, estimate, size in _partitions(conn, names):
            child = names.child(relname)
            is_default = bounds is None
            try:
                # A savepoint each: a relay's maintenance may drop a partition between the
                # listing and its count; it is then left out, not reported as the table
                # missing.
                with conn.transaction():
                    pending, failed = conn.execute(
                        q.render(q.COUNT_STATE, partition=child)
                    ).fetchone() or (0, 0)
                    if exact or is_default or estimate < 0:
                        # The default partition is counted exactly: any row in it is news.
                        (rows,) = conn.execute(
                            q.render(q.COUNT_ALL, partition=child)
                        ).fetchone() or (0,)
                        counted = True
                    else:
                        rows, counted = estimate, False
            except pg_errors.UndefinedTable:
                continue
            infos.append(
                PartitionInfo(
                    regclass,
                    bounds[0] if bounds else None,
                    bounds[1] if bounds else None,
                    int(rows),
                    counted,
                    int(pending),
                    int(failed),
                    size,
                )
            )
    far = dt.datetime.max.replace(tzinfo=dt.UTC)
    return sorted(infos, key=lambda i: i.lower or far)


def _require_partitioned(conn: psycopg.Connection[Any], table: str) -> None:
    state = is_partitioned(conn, table)
    if state is None:
        raise table_missing(table)
    if not state:
        raise SchemaError(
            f"outbox table {table!r} is not partitioned: create it with"
            " `outboxkit migrate --partition-by day` (docs/operations.md, 'Partitioned outbox',"
            " converts an existing table)"
        )


# -- migrate -----------------------------------------------------------------------------


def prepare_migration(
    conn: psycopg.Connection[Any], stmts: Statements, partition_by: PartitionBy
) -> None:
    """Make ``migrate(partition_by=...)`` create a partitioned table, or refuse.

    Runs inside migrate's transaction after its lock. An existing plain table is refused
    when it holds rows (converting it is a manual, planned step: docs/operations.md), and
    replaced when empty. ``migrate`` then runs the partitioned schema's files.
    """
    table = stmts.table
    state = is_partitioned(conn, table)
    if state is False:
        conn.execute(q.render(q.LOCK_EXCLUSIVE, table=sql.SQL(stmts.qualified)))
        has_rows = conn.execute(q.render(q.HAS_ROWS, table=sql.SQL(stmts.qualified))).fetchone()
        if has_rows and has_rows[0]:
            raise SchemaError(
                f"outbox table {table!r} exists, is not partitioned and holds rows:"
                " outboxkit does not convert it in place (it would rewrite every row under a"
                " lock). Follow 'Converting an existing outbox' in docs/operations.md"
                " (create the partitioned table under another name, switch writers, drain"
                " the old one), or drop the empty table first"
            )
        conn.execute(q.render(q.DROP_PARTITION, partition=sql.SQL(stmts.qualified)))


def finish_migration(
    conn: psycopg.Connection[Any], table: str, partition_by: PartitionBy
) -> list[str]:
    """After migrate's DDL: the settings comment, the default partition and those ahead."""
    settings = read_settings(conn, table)
    if settings is None:
        settings = PartitionSettings(partition_by)
    elif settings.by != partition_by:
        raise SchemaError(
            f"outbox table {table!r} is partitioned by {settings.by}, not {partition_by}:"
            " a table keeps its granularity (create a new one to change it)"
        )
    write_settings(conn, table, settings)
    created, _moved, _deferred = ensure_partitions(conn, table, settings)
    return created


# -- maintenance -------------------------------------------------------------------------


def ensure_partitions(
    conn: psycopg.Connection[Any],
    table: str,
    settings: PartitionSettings,
    *,
    now: dt.datetime | None = None,
    lock_timeout: dt.timedelta | None = None,
) -> tuple[list[str], int, list[str]]:
    """Create the default partition, the current and ``ahead`` periods, and the periods of
    stray rows in the default partition (moved in). Returns (created, moved rows, deferred)."""
    names = _Names.of(table)
    now = now or dt.datetime.now(dt.UTC)
    default = default_partition_name(names.name)
    storage = sql.SQL(q.PARTITION_STORAGE)
    existing = _partitions(conn, names)
    created: list[str] = []
    deferred: list[str] = []
    moved = 0
    # The default partition as found (someone may have made one by another name).
    default = next((rel for _, rel, b, _, _ in existing if b is None), default)
    has_default = any(b is None for _, _, b, _, _ in existing)
    if not has_default:
        try:
            with _step(conn, lock_timeout):
                create_default = q.render(
                    q.CREATE_DEFAULT,
                    partition=names.child(default),
                    table=names.ident,
                    storage=storage,
                )
                conn.execute(create_default)
        except pg_errors.LockNotAvailable:
            deferred.append(default)
        else:
            created.append(default)
            has_default = True
    strays: list[dt.datetime] = []
    if has_default:
        found = conn.execute(
            q.render(q.STRAY_PERIODS, partition=names.child(default)), (settings.by,)
        )
        strays = [start for (start,) in found.fetchall()]
    ranges = [b for _, _, b, _, _ in existing if b is not None]
    for period in periods_to_create(names.name, settings, now, ranges, strays):
        create = q.render(
            q.CREATE_PARTITION,
            partition=names.child(period.name),
            table=names.ident,
            lower=q.bound(period.start),
            upper=q.bound(period.end),
            storage=storage,
        )
        try:
            with _step(conn, lock_timeout):
                if period.holds_strays:
                    moved += _create_moving_strays(
                        conn, names, default, create, period.start, period.end
                    )
                else:
                    conn.execute(create)
        except pg_errors.LockNotAvailable:
            deferred.append(period.name)
            continue
        created.append(period.name)
    return created, moved, deferred


def _create_moving_strays(
    conn: psycopg.Connection[Any],
    names: _Names,
    default: str,
    create: sql.Composed,
    start: dt.datetime,
    end: dt.datetime,
) -> int:
    """Create a partition whose range rows of the default partition hold: move them in."""
    conn.execute(q.render(q.LOCK_EXCLUSIVE, table=names.ident))
    conn.execute(q.render(q.STASH_TABLE, table=names.ident))
    cur = conn.execute(q.render(q.STASH_ROWS, partition=names.child(default)), (start, end))
    moved = cur.rowcount
    conn.execute(create)
    columns = [c for (c,) in conn.execute(q.STORED_COLUMNS, (names.regclass,)).fetchall()]
    listed = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    conn.execute(q.render(q.RESTORE_ROWS, table=names.ident, columns=listed))
    conn.execute("DROP TABLE outboxkit_stray")
    return moved


@contextmanager
def _step(conn: psycopg.Connection[Any], lock_timeout: dt.timedelta | None) -> Iterator[None]:
    """One DDL step in its own transaction (a savepoint inside migrate's)."""
    with conn.transaction():
        if lock_timeout is not None:
            conn.execute(q.SET_LOCK_TIMEOUT, (f"{int(lock_timeout.total_seconds() * 1000)}ms",))
        yield


def drop_expired(
    conn: psycopg.Connection[Any],
    table: str,
    keep: dt.timedelta,
    *,
    now: dt.datetime | None = None,
    lock_timeout: dt.timedelta | None = DEFAULT_LOCK_TIMEOUT,
    confirmed_through: dt.datetime | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[str], list[KeptPartition], list[str]]:
    """Drop every partition wholly older than ``keep`` holding no pending or failed row.

    Returns (dropped, kept, deferred). ``confirmed_through`` is for a relay that never
    updates a row (the WAL relay's table source): its rows stay pending, so pending rows do
    not block a drop, but the partition must end before that commit time (everything up to
    it reached the broker); failed rows (dead letters) still do.
    """
    names = _Names.of(table)
    horizon = drop_horizon(now or dt.datetime.now(dt.UTC), keep, confirmed_through)
    dropped: list[str] = []
    kept: list[KeptPartition] = []
    deferred: list[str] = []
    for regclass, relname, bounds, _rows, _size in _partitions(conn, names):
        if not has_expired(bounds, horizon):
            continue
        child = names.child(relname)
        check = q.render(q.HOLDS_UNSETTLED, partition=child)
        pending, failed = conn.execute(check).fetchone() or (False, False)
        if blocks_drop(pending, failed, confirmed_through=confirmed_through):
            counts = conn.execute(q.render(q.COUNT_STATE, partition=child)).fetchone() or (0, 0)
            counted = pending and confirmed_through is None
            kept.append(
                KeptPartition(
                    regclass, int(counts[0]) if counted else 0, int(counts[1]) if failed else 0
                )
            )
            continue
        try:
            with _step(conn, lock_timeout):
                # The parent first, as every writer and claim locks it: no deadlock.
                conn.execute(q.render(q.LOCK_EXCLUSIVE, table=names.ident))
                pending, failed = conn.execute(check).fetchone() or (False, False)
                if blocks_drop(pending, failed, confirmed_through=confirmed_through):
                    # a row changed since the first look
                    counted = pending and confirmed_through is None
                    kept.append(KeptPartition(regclass, int(bool(counted)), int(bool(failed))))
                    continue
                conn.execute(q.render(q.DROP_PARTITION, partition=child))
        except pg_errors.LockNotAvailable:
            deferred.append(regclass)
            continue
        dropped.append(regclass)
        if progress is not None:
            progress(regclass)
    return dropped, kept, deferred


def maintain(
    source: Source,
    table: str = DEFAULT_TABLE,
    *,
    keep: dt.timedelta | None = None,
    ahead: int | None = None,
    now: dt.datetime | None = None,
    lock_timeout: dt.timedelta = DEFAULT_LOCK_TIMEOUT,
    confirmed_through: dt.datetime | None = None,
    progress: Callable[[str], None] | None = None,
) -> MaintenanceReport:
    """Create the partitions ahead and drop the expired ones; one run at a time per table.

    ``keep`` and ``ahead`` default to the table's settings (``migrate --partition-by``).
    Another run holding the table's maintenance lock makes this one return at once with
    ``skipped`` set. See :func:`drop_expired` for ``confirmed_through``.
    """
    report = MaintenanceReport(table)
    key = _lock_key(table)
    with admin_connection(source, lambda: table_missing(table)) as conn:
        settings = _settings(conn, table, keep, ahead)
        got = conn.execute(q.TRY_LOCK, (key,)).fetchone()
        if not got or not got[0]:
            report.skipped = "another maintenance of this table is running (advisory lock held)"
            return report
        try:
            created, moved, deferred = ensure_partitions(
                conn, table, settings, now=now, lock_timeout=lock_timeout
            )
            report.created, report.moved_rows, report.deferred = created, moved, deferred
            if progress is not None:
                for name in created:
                    progress(name)
            dropped, kept, deferred = drop_expired(
                conn,
                table,
                settings.keep,
                now=now,
                lock_timeout=lock_timeout,
                confirmed_through=confirmed_through,
                progress=progress,
            )
            report.dropped, report.kept = dropped, kept
            report.deferred += deferred
            report.stray_rows = stray_rows(conn, table)
        finally:
            if not conn.closed and not conn.broken:
                conn.execute(q.UNLOCK, (key,))
    return report


def stray_rows(source: Source, table: str = DEFAULT_TABLE) -> int:
    """Rows in the default partition (no partition covered their created_at): 0 is healthy.

    0 as well for a plain table (no default partition).
    """
    names = _Names.of(table)
    with admin_connection(source, lambda: table_missing(table)) as conn:
        found = conn.execute(q.FIND_DEFAULT, (names.regclass,)).fetchone()
        if found is None:
            return 0
        row = conn.execute(q.render(q.COUNT_STRAY, partition=names.child(found[0]))).fetchone()
        return int(row[0]) if row else 0


def drop_published_partitions(
    dsn: str,
    table: str = DEFAULT_TABLE,
    *,
    confirmed_through: dt.datetime,
    keep: dt.timedelta | None = None,
) -> MaintenanceReport:
    """For a relay that never updates rows (the WAL relay's table source): drop instead of delete.

    ``confirmed_through`` is the commit time up to which every event reached the broker;
    a partition ending at or before it (and older than ``keep``) is dropped, unless it holds
    a dead letter. Also creates the partitions ahead, like :func:`maintain`.
    """
    return maintain(dsn, table, keep=keep, confirmed_through=confirmed_through)


def partitioned_script(table: str, partition_by: str, *, now: dt.datetime | None = None) -> str:
    """``migrate --partition-by --print-sql``: the DDL of a partitioned outbox, with the
    default partition and those of today (or this hour) and the next periods, as of ``now``."""
    settings = PartitionSettings(check_partition_by(partition_by))
    names = _Names.of(table)
    stmts = Statements(table)
    storage = sql.SQL(q.PARTITION_STORAGE)
    parts = [
        q.render(
            q.CREATE_DEFAULT,
            partition=names.child(default_partition_name(names.name)),
            table=names.ident,
            storage=storage,
        )
    ]
    first = period_start(now or dt.datetime.now(dt.UTC), settings.by)
    for i in range(settings.ahead + 1):
        start = first + i * settings.period
        parts.append(
            q.render(
                q.CREATE_PARTITION,
                partition=names.child(partition_name(names.name, start, settings.by)),
                table=names.ident,
                lower=q.bound(start),
                upper=q.bound(start + settings.period),
                storage=storage,
            )
        )
    parts.append(
        q.render(q.SET_COMMENT, table=names.ident, comment=sql.Literal(settings.comment()))
    )
    extra = "".join(f"\n{p.as_string(None)};\n" for p in parts)
    note = (
        "\n-- Partitions ahead are created (and expired ones dropped) by the relay or by"
        " `outboxkit partitions maintain` (cron).\n"
    )
    return stmts.ddl(partitioned=True) + extra + note


class PartitionChore:
    """A relay's partition maintenance of one table (maintenance/side_task.py runs it)."""

    errors: tuple[type[Exception], ...] = (psycopg.Error, OutboxkitError)

    def __init__(self, dsn: str, table: str) -> None:
        self.dsn = dsn
        self.table = table

    def is_partitioned(self) -> bool:
        with connect(self.dsn, application_name=APPLICATION_NAME) as conn:
            return bool(is_partitioned(conn, self.table))

    def maintain(self) -> MaintenanceReport:
        with connect(self.dsn, application_name=APPLICATION_NAME) as conn:
            return maintain(conn, self.table)
