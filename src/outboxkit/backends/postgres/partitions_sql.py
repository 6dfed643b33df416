"""The SQL of a range-partitioned outbox table (``outboxkit migrate --partition-by day|hour``).

The parent is created by its own schema version 1,
backends/postgres/migrations/partitioned/0001_outbox.sql: the plain outbox's columns and indexes
with the two changes PostgreSQL requires of a partitioned table (the primary key includes the
partition key, ``(id, created_at)``, and the autovacuum settings move from the parent, which has no
storage, to each partition: :data:`PARTITION_STORAGE`). Later versions are the plain outbox's files.

Partitions are named ``<table>_pYYYYMMDD`` (day) or ``<table>_pYYYYMMDDHH`` (hour), in
UTC; ``<table>_default`` catches a row no partition covers (the maintenance stopped
for days): the maintenance moves such rows into their partition when it creates it.
"""

from __future__ import annotations

import datetime as dt
import re

from psycopg import sql

from outboxkit.backends.postgres.postgres import Status

#: The autovacuum settings of every partition: the plain outbox table's (the WITH clause of
# : backends/postgres/migrations/outbox/0001_outbox.sql; a partitioned parent has no storage to set
# them on).
#: tests/integration/test_migration_files.py holds the two equal.
PARTITION_STORAGE = (
    "autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 5000,"
    " autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 20000,"
    " autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 5000,"
    " autovacuum_vacuum_cost_delay = 0"
)

# Every SQL text below runs with TimeZone = 'UTC' (the bounds are read back as text).
SET_UTC = "SELECT set_config('TimeZone', 'UTC', true)"
SET_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %s, true)"
IS_PARTITIONED = "SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(%s)"
HAS_ROWS = "SELECT EXISTS (SELECT 1 FROM {table})"
LOCK_EXCLUSIVE = "LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
# The partition settings (granularity, retention window, periods ahead) ride on the parent's
# comment, so the relays and a cron job read the same ones.
GET_COMMENT = "SELECT obj_description(to_regclass(%s), 'pg_class')"
SET_COMMENT = "COMMENT ON TABLE {table} IS {comment}"
# One row per partition: its name (schema-qualified as regclass prints it), plain name,
# bound expression, estimated rows (-1: never analyzed) and total size.
LIST = """
SELECT c.oid::regclass::text, c.relname, pg_get_expr(c.relpartbound, c.oid),
       c.reltuples::bigint, pg_total_relation_size(c.oid)
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass(%s)
ORDER BY c.relname
"""
COUNT_ALL = "SELECT count(*) FROM {partition}"
# Through the partial indexes: cost follows the pending and failed rows, never the table.
COUNT_STATE = (
    f"SELECT (SELECT count(*) FROM {{partition}} WHERE status = {int(Status.PENDING)}),"
    f" (SELECT count(*) FROM {{partition}} WHERE status = {int(Status.FAILED)})"
)
HOLDS_UNSETTLED = (
    f"SELECT EXISTS (SELECT 1 FROM {{partition}} WHERE status = {int(Status.PENDING)}),"
    f" EXISTS (SELECT 1 FROM {{partition}} WHERE status = {int(Status.FAILED)})"
)
# The periods (UTC) the stray rows of the default partition fall in.
STRAY_PERIODS = """
SELECT DISTINCT date_trunc(%s, created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
FROM {partition}
"""
COUNT_STRAY = "SELECT count(*) FROM {partition}"
FIND_DEFAULT = """
SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass(%s) AND pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT'
"""
CREATE_PARTITION = (
    "CREATE TABLE {partition} PARTITION OF {table} FOR VALUES FROM ({lower}) TO ({upper})"
    " WITH ({storage})"
)
CREATE_DEFAULT = (
    "CREATE TABLE IF NOT EXISTS {partition} PARTITION OF {table} DEFAULT WITH ({storage})"
)
DROP_PARTITION = "DROP TABLE {partition}"  # (also an empty plain outbox being replaced)
# Moving a period's stray rows out of the default partition before its own partition exists
# (PostgreSQL refuses to create a partition whose range rows of the default partition hold).
STASH_TABLE = "CREATE TEMP TABLE outboxkit_stray (LIKE {table}) ON COMMIT DROP"
STASH_ROWS = """
WITH moved AS (
    DELETE FROM {partition} WHERE created_at >= %s AND created_at < %s RETURNING *
)
INSERT INTO outboxkit_stray SELECT * FROM moved
"""
# Generated columns (the ordered mode's `partition`) are recomputed, not copied.
STORED_COLUMNS = """
SELECT attname FROM pg_attribute
WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
ORDER BY attnum
"""
RESTORE_ROWS = (
    "INSERT INTO {table} ({columns}) OVERRIDING SYSTEM VALUE SELECT {columns} FROM outboxkit_stray"
)
# One maintenance at a time per table (relays and cron jobs): a session-level try-lock.
TRY_LOCK = "SELECT pg_try_advisory_lock(%s)"
UNLOCK = "SELECT pg_advisory_unlock(%s)"


def ident(schema: str | None, name: str) -> sql.Composable:
    return sql.Identifier(schema, name) if schema else sql.Identifier(name)


def render(template: str, **slots: sql.Composable | str) -> sql.Composed:
    """``template`` with its ``{slot}`` identifiers or literals filled in (values stay params)."""
    return sql.SQL(template).format(
        **{k: sql.SQL(v) if isinstance(v, str) else v for k, v in slots.items()}
    )


def bound(at: dt.datetime) -> sql.Composable:
    """A partition bound literal (UTC timestamptz)."""
    return sql.Literal(at.astimezone(dt.UTC).isoformat())


_BOUND = re.compile(r"FOR VALUES FROM \('(?P<lower>[^']+)'\) TO \('(?P<upper>[^']+)'\)")


def parse_bounds(expr: str | None) -> tuple[dt.datetime, dt.datetime] | None:
    """The (lower, upper) of ``pg_get_expr(relpartbound)`` read in UTC; None for DEFAULT."""
    m = _BOUND.match(expr or "")
    if m is None:
        return None
    return (_timestamp(m.group("lower")), _timestamp(m.group("upper")))


def _timestamp(text: str) -> dt.datetime:
    value = dt.datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
