"""Every SQL statement of the PostgreSQL backend, named, in one place.

Statements are templates with ``{table}``/``{index}`` slots filled once per
outbox by :class:`Statements` through :func:`quote_table` (psycopg's identifier
quoting); values always travel as parameters. Placeholders are psycopg's
``%s``/``%(name)s``; the write path also renders the two insert statements in
asyncpg's ``$n`` style (:func:`numbered`).
"""

from __future__ import annotations

import functools
import re
import zlib
from enum import IntEnum
from typing import overload

from psycopg import sql

from outboxkit.backends.postgres.migrations import Kind, migration_files
from outboxkit.errors import ConfigurationError
from outboxkit.limits import STORE_MAX_HEADERS_BYTES, STORE_MAX_TEXT_BYTES


class Status(IntEnum):
    """A row's state, as stored in ``status`` and rendered into every statement below.

    Claimed rows stay PENDING: the lease lives in available_at.
    """

    PENDING = 0
    PUBLISHED = 1
    FAILED = 2


#: The outbox table every API and command uses unless given another.
DEFAULT_TABLE = "outbox"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def parse_table(name: str) -> tuple[str | None, str]:
    """Validate ``table`` or ``schema.table``; identifiers are plain SQL names."""
    if not isinstance(name, str):
        raise ConfigurationError(f"outbox table name must be a string, got {type(name).__name__}")
    parts = name.split(".")
    if len(parts) > 2 or not all(_IDENT.match(p) for p in parts):
        raise ConfigurationError(
            f"invalid outbox table name {name!r}: use letters, digits and underscores"
            " (at most 63, not starting with a digit), optionally as schema.table"
        )
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])


def table_identifier(schema: str | None, name: str) -> sql.Identifier:
    """The one identifier-quoting function: every table name in SQL goes through it."""
    return sql.Identifier(schema, name) if schema else sql.Identifier(name)


def quote_table(schema: str | None, name: str) -> str:
    """:func:`table_identifier` as text, for the templates rendered with ``str.format``."""
    return table_identifier(schema, name).as_string(None)


def schema_slots(table: str) -> dict[str, sql.Composable]:
    """The placeholders of the outbox's migration files (backends/postgres/migrations/) for
    ``table``."""
    schema, name = parse_table(table)
    return {
        "table": table_identifier(schema, name),
        # an index lives in its table's schema: its name is never qualified
        "index_pending": sql.Identifier(f"{name}_pending_idx"[:63]),
        "index_failed": sql.Identifier(f"{name}_failed_idx"[:63]),
        "index_published": sql.Identifier(f"{name}_published_idx"[:63]),
        **{state.name.lower(): sql.Literal(int(state)) for state in Status},
    }


def channel_for(table: str) -> str:
    """The LISTEN/NOTIFY channel of an outbox (channel names are at most 63 bytes)."""
    channel = f"outboxkit_{table.replace('.', '_')}"
    if len(channel) > 63:
        channel = f"outboxkit_{zlib.crc32(table.encode()):08x}"
    return channel


# --- schema -------------------------------------------------------------------

# One migration per schema version, each a file of backends/postgres/migrations/outbox/ (templates
# with {placeholders}: schema_slots fills them); each runs in the migrating transaction.
MIGRATIONS: dict[int, str] = {f.version: f.template for f in migration_files("outbox")}
SCHEMA_VERSION = max(MIGRATIONS)

#: Where `outboxkit migrate` records each outbox's schema version (in the outbox's schema).
VERSIONS_TABLE = "outboxkit_schema_versions"
CREATE_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS {versions} (
    table_name text PRIMARY KEY,
    version    integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""
# Serialises concurrent `outboxkit migrate` runs (two deploys at once).
MIGRATION_LOCK = "SELECT pg_advisory_xact_lock(%s)"
GET_VERSION = "SELECT version FROM {versions} WHERE table_name = %s"
SET_VERSION = """
INSERT INTO {versions} (table_name, version) VALUES (%s, %s)
ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version, applied_at = now()
"""
TABLE_EXISTS = "SELECT to_regclass(%s) IS NOT NULL"
# What `migrate` finds missing: relations (tables, indexes) by quoted qualified name,
# then columns of one table by name.
MISSING_RELATIONS = "SELECT r FROM unnest(%s::text[]) AS r WHERE to_regclass(r) IS NULL"
MISSING_COLUMNS = """
SELECT c FROM unnest(%s::text[]) AS c
WHERE NOT EXISTS (
    SELECT 1 FROM pg_attribute
    WHERE attrelid = to_regclass(%s) AND attname = c AND attnum > 0 AND NOT attisdropped
)
"""

# --- write side ---------------------------------------------------------------

# The columns the write side fills, in this order, with their types. The INSERTs
# below and Outbox.transaction()'s binary parameter types (commit.py) are built
# from it; the rows the write encodes (write._row, commit._params) and the claim's
# RETURNING (in OutboundMessage's field order) are pinned to it by
# tests/unit/test_outbox_columns.py.
WRITE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("event_id", "uuid"),
    ("topic", "text"),
    ("key", "text"),
    ("event_type", "text"),
    ("aggregate_type", "text"),
    ("aggregate_id", "text"),
    ("payload", "bytea"),
    ("headers", "jsonb"),
    ("occurred_at", "timestamptz"),
    ("schema_version", "text"),
    ("available_at", "timestamptz"),
)
_COLUMNS = ", ".join(name for name, _ in WRITE_COLUMNS)
# available_at is NULL for an event without deliver_at/delay: the column's default, now().
# headers is NULL for an event without headers (most): a constant '{}' the plan folds once,
# instead of a JSON text parsed per row (~1 µs of server CPU per INSERT; bench/write_row_cost.py).
# ('{{{{}}}}' is '{}' once this and the statement templates are formatted.)
_VALUE = {"available_at": "coalesce({}, now())", "headers": "coalesce({}, '{{{{}}}}'::jsonb)"}


def _value(name: str, expr: str) -> str:
    return _VALUE.get(name, "{}").format(expr)


_VALUES_ONE = ", ".join(_value(name, f"%s::{pg_type}") for name, pg_type in WRITE_COLUMNS)
INSERT_ONE = f"INSERT INTO {{table}} ({_COLUMNS}) VALUES ({_VALUES_ONE})"
# One statement, one round trip, for any number of events: one array per column
# (the headers as text[], JSON documents cast one by one).
INSERT_MANY = f"""
INSERT INTO {{table}} ({_COLUMNS})
SELECT {", ".join(_value(name, f"u.{name}::{pg_type}") for name, pg_type in WRITE_COLUMNS)}
FROM unnest({", ".join(f"%s::{'text' if t == 'jsonb' else t}[]" for _, t in WRITE_COLUMNS)})
     AS u({_COLUMNS})
"""
# Ordered mode (Outbox(ordered=True)): before the rows take their identity ids, the
# statement takes a transaction-scoped advisory lock per distinct key, in hash order (so
# two writers cannot deadlock on each other's keys), held until COMMIT/ROLLBACK. Two
# transactions writing one key then get their ids in their commit order. The lock sits in
# an uncorrelated scalar subquery of the WHERE: PostgreSQL runs it once (an InitPlan of a
# one-time filter) before the first row is produced, and nextval() is evaluated when a row
# is produced (tests/integration/test_ordered_write.py shows it). Namespace: the table's
# oid, so every spelling of its name (schema-qualified or not) takes the same locks; the
# two-int form of the lock never meets the one-bigint form (MIGRATION_LOCK).
_LOCK_NAMESPACE = "({table_literal}::regclass::oid::bigint - 2147483648)::int4"
KEY_LOCKS = (
    f"(SELECT count(pg_advisory_xact_lock({_LOCK_NAMESPACE}, h))"
    " FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest(%s::text[]) AS k"
    " WHERE k IS NOT NULL ORDER BY h) AS keys)"
)
# One event, one key: a text parameter, no array to build (an array parameter costs the
# single put about 40 µs of client CPU more; bench/write_overhead.py).
KEY_LOCK = f"(SELECT pg_advisory_xact_lock({_LOCK_NAMESPACE}, hashtext(%s::text)))"
INSERT_ONE_ORDERED = (
    f"INSERT INTO {{table}} ({_COLUMNS}) SELECT {_VALUES_ONE} WHERE {KEY_LOCK} IS NOT NULL"
)
INSERT_MANY_ORDERED = INSERT_MANY.rstrip() + f"\nWHERE {KEY_LOCKS} >= 0\n"
# Outbox.transaction() in ordered mode: its first INSERT takes the locks of every key of
# the transaction (a text[]), before its own row and the later INSERTs take their ids.
INSERT_ONE_LOCKING_KEYS = (
    f"INSERT INTO {{table}} ({_COLUMNS}) SELECT {_VALUES_ONE} WHERE {KEY_LOCKS} >= 0"
)
# The wake-up gate (issue 14, docs/architecture.md): a NOTIFY makes its commit take a
# database-wide lock held through the commit's WAL flush, so notifying commits go one at
# a time. Writers notify only while a relay waits for work: such a relay holds the
# channel's advisory lock (session, exclusive: TRY_WAKE_LOCK), and a writer's try of the
# shared lock then fails. A writer whose try succeeds (no relay waiting) does not notify
# and holds the shared lock until its transaction ends, so a relay gets the exclusive
# lock only once those writers' rows are visible; it claims once more after taking it,
# and no wake-up is lost. The one-bigint form never meets the two-int key locks.
WAKE_GATE = "NOT pg_try_advisory_xact_lock_shared({wake_key})"
TRY_WAKE_LOCK = "SELECT pg_try_advisory_lock({wake_key})"
WAKE_UNLOCK = "SELECT pg_advisory_unlock({wake_key})"
# A wake-up's payload for rows not due yet (a delayed task): a waiting store does not claim
# for it, a parked one (_pg_session.py) probes for its due time, so it claims then.
LATER = "later"
# The notification rides in the same statement as the insert. PostgreSQL folds
# identical notifications of one transaction into one, delivered at commit.
NOTIFY_SUFFIX = "SELECT pg_notify(%s, '') WHERE " + WAKE_GATE
# Events attached to the caller's own statement (Outbox.execute_with) as a
# data-modifying CTE: PostgreSQL runs it exactly once whatever the main statement
# does, and RETURNING carries the notification (a plain SELECT CTE nobody
# references would not run).
ATTACHED_EVENTS = "outboxkit_events AS ({insert})"
ATTACHED_EVENTS_NOTIFY = (
    "outboxkit_events AS ({insert} RETURNING CASE WHEN "
    + WAKE_GATE
    + " THEN pg_notify(%s, '') END)"
)

# --- relay --------------------------------------------------------------------

# The relay's claim and settle sessions read timestamps in UTC. psycopg builds a
# timestamptz in the session's zone; for UTC it skips the conversion a named zone costs
# (even Etc/UTC): 0.86 -> 0.33 us per value, two per claimed row. The instants are the
# same; only their zone (and a non-UTC server's ce_time offset) changes. TimeZone is a
# parameter PgBouncer tracks and restores per client, so this holds behind it too.
SESSION_UTC = "SET TimeZone TO 'UTC'"

# Every relay statement may commit without waiting for its WAL flush: losing one
# of these writes in a database crash only means an event is published again
# (a lost claim or settle leaves the row pending; the fence turns the late settle
# into a no-op), which at-least-once delivery allows. set_config(..., true) is SET
# LOCAL: it lasts for the statement's own transaction, so no session state leaks
# to other clients through a transaction-pooling PgBouncer. The parameter is
# 'off', or NULL to keep the server's setting.
_COMMIT_MODE = (
    "(SELECT set_config('synchronous_commit',"
    " coalesce({value}, current_setting('synchronous_commit')), true)) IS NOT NULL"
)
_COMMIT_NAMED = _COMMIT_MODE.format(value="%(commit)s::text")
_COMMIT_POSITIONAL = _COMMIT_MODE.format(value="%s::text")

# available_at is both the retry time and the lease: a claim pushes it to the
# lease expiry, so a relay that dies mid-batch needs no cleanup job: its rows
# become claimable again when the lease runs out. claim_token fences the settle.
# `= ANY(ARRAY(...))` makes the plan fixed: lock the batch through the pending
# index, then update exactly those rows through the primary key. (`IN (SELECT ...)`
# lets the planner hash-join against a sequential scan of the whole table once the
# table is small enough, which made the claim 20 % slower while a backlog drained.)
# RETURNING lists the columns in OutboundMessage's field order after the id;
# occurred_at is NULL only in rows written before schema version 2. The headers go out
# as json, not jsonb: json's binary form is the plain text, which the relay's loader
# hands to orjson without a Python frame per row (backends/postgres/queue_pg.py JsonLoader); jsonb's
# carries a version byte to strip in Python first.
#
# A row over the sizes the relay loads (a field of a row written around Event(), by
# plain SQL or an older version: outboxkit.limits) is dead-lettered by the claim
# itself and never returned, so it cannot fill the relay's memory. The sizes come
# from the row headers (octet_length of a TOASTed value reads no data); the headers'
# JSON text is rendered only for the rare row whose stored headers are large.
#
# The crash-loop guard: a claimable row already claimed max_attempts times (attempts
# counts claims; a failure settle dead-letters the last one) was never settled by the
# relay that held it last: each relay died or hung publishing it. The claim
# dead-letters it with an error that says so instead of handing it to the next victim.
# The claim's shared parts (the ordered claim in backends/postgres/ordered_sql.py uses them too):
# the dead-lettering of a crash-looping or oversized row of `batch`, the lease the
# claim writes, and the columns it returns (`OutboundMessage`'s order). The ordered claim
# returns the rows it dead-lettered too (claimed UNION ALL the dead), their error in a last
# column, so the relay counts and logs them: their bounded text fields only, never a payload.
_DEAD_SET = """
    UPDATE {table} AS d
    SET status = {failed}, attempts = d.attempts + (d.attempts < %(max_attempts)s)::int,
        claim_token = NULL, claimed_by = %(relay_id)s,
        last_error = CASE WHEN d.attempts >= %(max_attempts)s THEN {looped_error}
                          ELSE {oversized_error} END
"""
_DEAD_RETURNING = """
    RETURNING d.id, d.event_id, left(d.topic, 200), NULL::text, left(d.event_type, 200),
              NULL::text, NULL::text, ''::bytea, '{{}}'::json, d.created_at, d.attempts,
              coalesce(d.occurred_at, d.created_at), d.schema_version, d.last_error
"""
DEAD_ON_CLAIM = (
    _DEAD_SET
    + """    WHERE d.id = ANY(ARRAY(
        SELECT id FROM batch WHERE oversized IS NOT NULL OR attempts >= %(max_attempts)s))"""
    + _DEAD_RETURNING
)
CLAIM_LEASE = """
UPDATE {table} AS o
SET attempts = o.attempts + 1,
    available_at = now() + make_interval(secs => %(lease)s),
    claim_token = %(token)s,
    claimed_by = %(relay_id)s
"""
CLAIM_RETURNING = """
RETURNING o.id, o.event_id, o.topic, o.key, o.event_type, o.aggregate_type, o.aggregate_id,
          o.payload, o.headers::json, o.created_at, o.attempts,
          coalesce(o.occurred_at, o.created_at), o.schema_version
"""
CLAIM_BATCH = (
    """
WITH batch AS MATERIALIZED (
    SELECT id, attempts, {oversized} AS oversized FROM {table}
    WHERE status = {pending} AND available_at <= now()
    ORDER BY available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), claimed AS ("""
    + CLAIM_LEASE
    + """WHERE o.id = ANY(ARRAY(
    SELECT id FROM batch WHERE oversized IS NULL AND attempts < %(max_attempts)s))
  AND {commit_named}"""
    + CLAIM_RETURNING
    + ") SELECT *, NULL::text FROM claimed UNION ALL"
    " SELECT id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, attempts, NULL, NULL, ''"
    " FROM batch WHERE oversized IS NOT NULL OR attempts >= %(max_attempts)s"
)
# The claim dead-letters nothing itself: a crash-looping or oversized row of its batch is
# left as it was, answered as a row of its id and an empty last column, and the relay then
# dead-letters those ids with DEAD_LETTER, a statement of its own run only then. The
# dead-lettering UPDATE the claim held before was set up by every claim though it almost
# never had a row (docs/benchmarks.md, "The claim's fixed cost"). Between the two
# statements the rows are unlocked, so DEAD_LETTER checks them again: still pending, due
# (not claimed since, by a relay with a higher max_attempts) and crash-looping or oversized.
DEAD_LETTER = (
    _DEAD_SET
    + """    WHERE d.id = ANY(%(dead)s) AND d.status = {pending} AND d.available_at <= now()
      AND ({oversized_d} IS NOT NULL OR d.attempts >= %(max_attempts)s) AND {commit_named}"""
    + _DEAD_RETURNING
)
# A parked relay's poll (backends/postgres/_pg_session.py, docs/fleet.md "Connections"): seconds
# until the first pending row may be claimed (0 or less: now; NULL: none), on its LISTEN
# session instead of a claim on a connection of its own. The claim's own index scan (the
# pending index in available_at order), one row read; a future available_at is a retry's
# time or a claimed row's lease expiry, waited for with a timer.
DUE_IN = """
SELECT extract(epoch FROM (
    SELECT available_at FROM {table} WHERE status = {pending} ORDER BY available_at, id LIMIT 1
) - now())::float8
"""
# The settles return the ids they changed: when the fence drops rows (another relay
# re-claimed them) the relay reports exactly which rows it settled. (The relay reads
# them only then; a full settle is told by its row count.)
SETTLE_PUBLISHED_DELETE = (
    "DELETE FROM {table} WHERE id = ANY(%s) AND claim_token = %s AND {commit_positional}"
    " RETURNING id"
)
# What marking a row published writes (retention = keep); the fenced settle of ordered mode
# (backends/postgres/ordered_sql.py) writes the same.
PUBLISHED_SET = (
    "SET status = {published}, published_at = now(), claim_token = NULL, last_error = NULL"
)
SETTLE_PUBLISHED_KEEP = f"""
UPDATE {{table}}
{PUBLISHED_SET}
WHERE id = ANY(%s) AND claim_token = %s AND {{commit_positional}}
RETURNING id
"""
# A whole claim published (the common case): the claim's token names exactly its rows
# (one token per claim; a row re-claimed since has another), so the id range only
# narrows the primary-key scan. No id array to send: its adaptation was 5 % of a
# relay's event-loop time at 1 000 events a batch.
SETTLE_CLAIM_DELETE = (
    "DELETE FROM {table} WHERE id BETWEEN %s AND %s AND claim_token = %s"
    " AND {commit_positional} RETURNING id"
)
SETTLE_CLAIM_KEEP = f"""
UPDATE {{table}}
{PUBLISHED_SET}
WHERE id BETWEEN %s AND %s AND claim_token = %s AND {{commit_positional}}
RETURNING id
"""
# The claim that also settles the claim before it, published whole (queue/carry.py): one
# statement and one commit a cycle instead of two at the steady rates where a claim finds
# a few events (bench/relay_steady.py). The settle is SETTLE_CLAIM_DELETE's (or _KEEP's),
# fenced by its token; its rows are leased (available_at in the future), so the claim's
# batch never meets them. It answers with one more row, its id NULL: the settled claim's
# token (event_id), how many rows it changed (attempts) and their ids (topic, as text; read
# only when the fence dropped some). A failed statement settles nothing and claims nothing.
_CARRIED_ROW = (
    " UNION ALL SELECT NULL, %(settle_token)s::uuid, string_agg(id::text, ','), NULL, NULL,"
    " NULL, NULL, NULL, NULL, NULL, count(*)::int, NULL, NULL, NULL FROM settled"
    " HAVING count(*) > 0"
)
_CARRIED_RANGE = (
    "id BETWEEN %(settle_lo)s AND %(settle_hi)s AND claim_token = %(settle_token)s::uuid"
    " AND {commit_named}"
)
CLAIM_SETTLING_DELETE = (
    f"WITH settled AS (DELETE FROM {{table}} WHERE {_CARRIED_RANGE} RETURNING id),"
    + CLAIM_BATCH.lstrip().removeprefix("WITH")
    + _CARRIED_ROW
)
CLAIM_SETTLING_KEEP = (
    f"WITH settled AS (UPDATE {{table}} {PUBLISHED_SET} WHERE {_CARRIED_RANGE}"
    " RETURNING id)," + CLAIM_BATCH.lstrip().removeprefix("WITH") + _CARRIED_ROW
)
# Failures of one batch in one statement: each row gets its own delay, error and
# next state (pending again, or failed once out of attempts or rejected for good).
# `refund` gives back the claim's attempt of a row the publisher handed back untried.
# (FAILURES_UPDATE is shared with ordered mode's fenced settle: the rows `o`, their updates `u`.)
FAILURES_UPDATE = """
UPDATE {table} AS o
SET status = u.next_status,
    available_at = now() + make_interval(secs => u.delay),
    last_error = u.error,
    claim_token = NULL,
    attempts = greatest(o.attempts - u.refund, 0)
FROM unnest(%s::bigint[], %s::smallint[], %s::float8[], %s::text[], %s::int[])
     AS u(id, next_status, delay, error, refund)
"""
SETTLE_FAILURES = (
    FAILURES_UPDATE
    + """WHERE o.id = u.id AND o.claim_token = %s AND {commit_positional}
RETURNING o.id
"""
)
# On shutdown: hand unpublished rows back at once, and give back the attempt.
RELEASE_LEASES = """
UPDATE {table}
SET available_at = now(), claim_token = NULL, attempts = greatest(attempts - 1, 0)
WHERE id = ANY(%s) AND claim_token = %s AND {commit_positional}
"""

# The lease heartbeat: while a batch's publish runs longer than a third of the lease, the
# relay pushes its rows' lease out again every lease/3, fenced by the claim token (a row
# another relay re-claimed is left alone). A relay that dies stops extending: its rows
# come back within one lease, as before.
EXTEND_LEASES = """
UPDATE {table}
SET available_at = now() + make_interval(secs => %s)
WHERE id = ANY(%s) AND claim_token = %s AND {commit_positional}
"""

# The end of a broker outage (issue 26 item 7): rows handed back while the broker was
# down were paced by a growing delay; once it is back they are due at once (their
# attempt was refunded already). Rows claimed or settled since are left alone.
HASTEN_HANDED_BACK = """
UPDATE {table}
SET available_at = now()
WHERE id = ANY(%s) AND status = {pending} AND claim_token IS NULL AND available_at > now()
  AND {commit_positional}
"""
# Can this role settle? (UPDATE, and DELETE under retention=delete, on a writable server.)
# Refused at start in one line rather than found out by the first settle, after publishing.
CHECK_WRITE_RIGHTS = """
SELECT has_table_privilege({table_literal}, 'UPDATE')
           OR (has_column_privilege({table_literal}, 'status', 'UPDATE')
               AND has_column_privilege({table_literal}, 'attempts', 'UPDATE')
               AND has_column_privilege({table_literal}, 'available_at', 'UPDATE')
               AND has_column_privilege({table_literal}, 'claim_token', 'UPDATE')
               AND has_column_privilege({table_literal}, 'claimed_by', 'UPDATE')
               AND has_column_privilege({table_literal}, 'last_error', 'UPDATE')),
       has_table_privilege({table_literal}, 'DELETE'),
       current_setting('transaction_read_only') = 'on'
"""

# --- ops ----------------------------------------------------------------------

# A scheduled event (Event(deliver_at=...)) is pending but not late before its time: the
# oldest-pending age (status, the dashboard, OutboxOldestPendingTooOld) skips a row
# never tried whose time has not come, and counts a due one from its time, not from its
# write. (A row handed back during an outage also has attempts 0, but carries last_error:
# it stays counted from its write, so the age keeps growing through the outage.)
_NOT_DUE = "(attempts = 0 AND claim_token IS NULL AND last_error IS NULL AND available_at > now())"
_WAITING_SINCE = (
    "CASE WHEN attempts = 0 AND claim_token IS NULL AND last_error IS NULL"
    " THEN greatest(created_at, available_at) ELSE created_at END"
)
STATUS_BY_TOPIC = """
SELECT topic,
       count(*) FILTER (
           WHERE status = {pending} AND NOT (claim_token IS NOT NULL AND available_at > now())
       ) AS pending,
       count(*) FILTER (
           WHERE status = {pending} AND claim_token IS NOT NULL AND available_at > now()
       ) AS in_flight,
       count(*) FILTER (WHERE status = {failed}) AS failed,
       count(*) FILTER (WHERE status = {published}) AS published,
       extract(epoch FROM now() - min({waiting_since}) FILTER (
           WHERE status = {pending} AND NOT {not_due}
       ))::float8 AS oldest_pending_age_s
FROM {table}
GROUP BY topic
ORDER BY topic
"""
LIST_FAILED = """
SELECT id, event_id, topic, event_type, key, attempts, last_error, created_at
FROM {table} WHERE status = {failed} AND (%(topic)s::text IS NULL OR topic = %(topic)s)
ORDER BY id LIMIT %(limit)s
"""
# `outboxkit failed show`: every column of one row, by row id or by event id.
_EVENT_COLUMNS = """id, event_id, topic, key, event_type, aggregate_type, aggregate_id, payload,
       headers, schema_version, occurred_at, status, attempts, available_at, claim_token,
       claimed_by, last_error, created_at, published_at"""
SHOW_EVENT = "SELECT {event_columns} FROM {table} WHERE id = %s"
SHOW_EVENT_BY_EVENT_ID = "SELECT {event_columns} FROM {table} WHERE event_id = %s"
# The testing kit's `outbox_events`: every row, in write order.
LIST_EVENTS = "SELECT {event_columns} FROM {table} ORDER BY id"
# Replay puts dead letters back in line with a fresh attempt budget.
REPLAY_BY_ID = """
UPDATE {table} SET status = {pending}, attempts = 0, available_at = now(), claim_token = NULL
WHERE id = ANY(%s) AND status = {failed}
"""
REPLAY_BY_TOPIC = """
UPDATE {table} SET status = {pending}, attempts = 0, available_at = now(), claim_token = NULL
WHERE status = {failed} AND topic = %s
"""
REPLAY_ALL_FAILED = """
UPDATE {table} SET status = {pending}, attempts = 0, available_at = now(), claim_token = NULL
WHERE status = {failed}
"""
# Small batches keep each transaction short and the vacuum debt bounded.
PURGE_PUBLISHED_BATCH = """
DELETE FROM {table} WHERE id IN (
    SELECT id FROM {table}
    WHERE status = {published} AND published_at < now() - make_interval(secs => %s)
    ORDER BY published_at LIMIT %s
)
"""
COUNT_PURGEABLE = """
SELECT count(*) FROM {table}
WHERE status = {published} AND published_at < now() - make_interval(secs => %s)
"""
# Metric gauges, read every few seconds by each relay: only pending and failed
# rows (partial indexes), never published ones, and at most %(cap)s rows each, so
# the cost stays flat however large the table or the backlog grows.
METRICS_PENDING_BY_TOPIC = """
SELECT topic,
       count(*) FILTER (WHERE NOT (claim_token IS NOT NULL AND available_at > now())),
       count(*) FILTER (WHERE claim_token IS NOT NULL AND available_at > now()),
       extract(epoch FROM now() - min({waiting_since}) FILTER (WHERE NOT {not_due}))::float8
FROM (SELECT topic, claim_token, available_at, created_at, attempts, last_error FROM {table}
      WHERE status = {pending} ORDER BY available_at, id LIMIT %(cap)s) AS p
GROUP BY topic
"""
# The relay's start-up line: pending rows through the pending index, counted up to a cap.
# Every column the write and the claim use, read from no row: fails on a table an older
# schema version left (the relay says "run migrate" at start instead of failing each claim).
CHECK_COLUMNS = f"SELECT {_COLUMNS}, created_at, attempts FROM {{table}} LIMIT 0"
COUNT_PENDING_CAPPED = (
    "SELECT count(*) FROM (SELECT 1 FROM {table} WHERE status = {pending} LIMIT %(cap)s) AS p"
)
METRICS_FAILED_BY_TOPIC = """
SELECT topic, count(*)
FROM (SELECT topic FROM {table} WHERE status = {failed} ORDER BY id LIMIT %(cap)s) AS f
GROUP BY topic
"""
# The last id the table's identity sequence handed out (max(id) would go back down as
# published rows are deleted): with the backlog, how many events left the outbox since the
# last reading (dashboard throughput). The parameter is the quoted table name.
LAST_EVENT_ID = "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence(%s, 'id')), 0)"
# Discard deletes a dead letter for good (the operator decided it must never be published).
DISCARD_FAILED_BY_ID = "DELETE FROM {table} WHERE id = ANY(%s) AND status = {failed}"


def _oversized(alias: str) -> str:
    """SQL: the name and size of the first field over what the relay loads, or NULL."""
    text, headers = STORE_MAX_TEXT_BYTES, STORE_MAX_HEADERS_BYTES
    whens = "".join(
        f" WHEN octet_length({alias}{column}) > {text}"
        f" THEN '{column} is ' || octet_length({alias}{column}) || ' bytes'"
        for column in ("topic", "key", "event_type", "aggregate_type", "aggregate_id")
    )
    big_headers = (
        f"CASE WHEN pg_column_size({alias}headers) > 1024"
        f" THEN octet_length({alias}headers::text) > {headers} ELSE false END"
    )
    return (
        f"CASE{whens} WHEN {big_headers}"
        f" THEN 'headers are ' || octet_length({alias}headers::text) || ' bytes of JSON' END"
    )


def _looped_error(alias: str) -> str:
    """SQL: the last_error of a row the crash-loop guard dead-letters, its last error kept.

    A claim token left on the row means the relay that claimed it last never settled it
    (died or hung publishing it); none means a settle handed it back as a retry, so it
    only reached this relay's max_attempts, lower than the one that retried it before.
    """
    return (
        f"CASE WHEN {alias}claim_token IS NOT NULL THEN 'relay: claimed ' || {alias}attempts"
        " || ' times (max_attempts) and never settled: each relay that claimed it died or"
        " hung publishing it (a message that crashes or hangs the relay, an OOM?)."
        " Dead-lettered without publishing it again: inspect it with `outboxkit failed"
        " show`, then replay or discard it'"
        f" ELSE 'relay: tried ' || {alias}attempts || ' times already, as many as this"
        " relay''s max_attempts (' || %(max_attempts)s || '): a relay with a higher"
        " max_attempts retried it before. Dead-lettered without publishing it again:"
        " give the relays one --max-attempts, then replay it' END"
        f" || coalesce('. Last error: ' || left({alias}last_error, 1000), '')"
    )


def _oversized_error(alias: str) -> str:
    return (
        f"'relay: ' || {_oversized(alias)} || ', over what the relay loads"
        f" ({STORE_MAX_TEXT_BYTES} bytes per text field, {STORE_MAX_HEADERS_BYTES} of"
        " headers): the row was written around outboxkit.Event (plain SQL or an older"
        " version), dead-lettered unread. Fix the row and replay it, or discard it'"
    )


class SqlTemplate:
    """One named statement template of a :class:`NamedStatements` class.

    Its attribute name is the statement's name; on an instance it reads as the
    text rendered for that table (a plain instance attribute, set once at
    construction). ``aliases`` fill a slot with a statement rendered
    before this one, e.g. ``insert="insert_one"``.
    """

    def __init__(self, template: str, **aliases: str) -> None:
        self.template = template
        self.aliases = aliases
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> SqlTemplate: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> str: ...
    def __get__(self, obj: object, owner: type | None = None) -> SqlTemplate | str:
        if obj is None:
            return self
        raise AttributeError(f"statement {self.name!r} was not rendered")  # pragma: no cover

    def render(self, slots: dict[str, str], rendered: dict[str, str]) -> str:
        extra = {slot: rendered[name] for slot, name in self.aliases.items()}
        return self.template.format(**slots, **rendered, **extra).strip()


class NamedStatements:
    """Base of a table's statement set: its class body is the table of named templates.

    Each ``SqlTemplate`` attribute is rendered in order by :meth:`_render` (a later template
    may embed an earlier statement by name) into an instance attribute of that name.
    """

    @classmethod
    def templates(cls) -> dict[str, SqlTemplate]:
        """Every named template, in rendering order."""
        return {k: v for k, v in vars(cls).items() if isinstance(v, SqlTemplate)}

    def _render(self, slots: dict[str, str]) -> None:
        rendered: dict[str, str] = {}
        for statement in self.templates().values():
            rendered[statement.name] = statement.render(slots, rendered)
        self.__dict__.update(rendered)  # instance attributes: the templates stay on the class


class Statements(NamedStatements):
    """The statements of one outbox table, rendered once with its quoted name."""

    create_version_table = SqlTemplate(CREATE_VERSION_TABLE)
    get_version = SqlTemplate(GET_VERSION)
    set_version = SqlTemplate(SET_VERSION)
    insert_one = SqlTemplate(INSERT_ONE)
    insert_many = SqlTemplate(INSERT_MANY)
    insert_one_notify = SqlTemplate("WITH ins AS ({insert_one}) " + NOTIFY_SUFFIX)
    insert_many_notify = SqlTemplate("WITH ins AS ({insert_many}) " + NOTIFY_SUFFIX)
    attached_one = SqlTemplate(ATTACHED_EVENTS, insert="insert_one")
    attached_many = SqlTemplate(ATTACHED_EVENTS, insert="insert_many")
    attached_one_notify = SqlTemplate(ATTACHED_EVENTS_NOTIFY, insert="insert_one")
    attached_many_notify = SqlTemplate(ATTACHED_EVENTS_NOTIFY, insert="insert_many")
    insert_one_ordered = SqlTemplate(INSERT_ONE_ORDERED)
    insert_many_ordered = SqlTemplate(INSERT_MANY_ORDERED)
    insert_one_ordered_notify = SqlTemplate("WITH ins AS ({insert_one_ordered}) " + NOTIFY_SUFFIX)
    insert_many_ordered_notify = SqlTemplate("WITH ins AS ({insert_many_ordered}) " + NOTIFY_SUFFIX)
    attached_one_ordered = SqlTemplate(ATTACHED_EVENTS, insert="insert_one_ordered")
    attached_many_ordered = SqlTemplate(ATTACHED_EVENTS, insert="insert_many_ordered")
    attached_one_ordered_notify = SqlTemplate(ATTACHED_EVENTS_NOTIFY, insert="insert_one_ordered")
    attached_many_ordered_notify = SqlTemplate(ATTACHED_EVENTS_NOTIFY, insert="insert_many_ordered")
    insert_one_locking_keys = SqlTemplate(INSERT_ONE_LOCKING_KEYS)
    insert_one_locking_keys_notify = SqlTemplate(
        "WITH ins AS ({insert_one_locking_keys}) " + NOTIFY_SUFFIX
    )
    claim_batch = SqlTemplate(CLAIM_BATCH)
    dead_letter = SqlTemplate(DEAD_LETTER)
    try_wake_lock = SqlTemplate(TRY_WAKE_LOCK)
    wake_unlock = SqlTemplate(WAKE_UNLOCK)
    settle_published_delete = SqlTemplate(SETTLE_PUBLISHED_DELETE)
    settle_published_keep = SqlTemplate(SETTLE_PUBLISHED_KEEP)
    settle_claim_delete = SqlTemplate(SETTLE_CLAIM_DELETE)
    settle_claim_keep = SqlTemplate(SETTLE_CLAIM_KEEP)
    claim_settling_delete = SqlTemplate(CLAIM_SETTLING_DELETE)
    claim_settling_keep = SqlTemplate(CLAIM_SETTLING_KEEP)
    settle_failures = SqlTemplate(SETTLE_FAILURES)
    release_leases = SqlTemplate(RELEASE_LEASES)
    extend_leases = SqlTemplate(EXTEND_LEASES)
    hasten_handed_back = SqlTemplate(HASTEN_HANDED_BACK)
    check_write_rights = SqlTemplate(CHECK_WRITE_RIGHTS)
    status_by_topic = SqlTemplate(STATUS_BY_TOPIC)
    list_failed = SqlTemplate(LIST_FAILED)
    show_event = SqlTemplate(SHOW_EVENT)
    show_event_by_event_id = SqlTemplate(SHOW_EVENT_BY_EVENT_ID)
    list_events = SqlTemplate(LIST_EVENTS)
    replay_by_id = SqlTemplate(REPLAY_BY_ID)
    replay_by_topic = SqlTemplate(REPLAY_BY_TOPIC)
    replay_all_failed = SqlTemplate(REPLAY_ALL_FAILED)
    purge_published_batch = SqlTemplate(PURGE_PUBLISHED_BATCH)
    count_purgeable = SqlTemplate(COUNT_PURGEABLE)
    metrics_pending_by_topic = SqlTemplate(METRICS_PENDING_BY_TOPIC)
    count_pending_capped = SqlTemplate(COUNT_PENDING_CAPPED)
    due_in = SqlTemplate(DUE_IN)
    check_columns = SqlTemplate(CHECK_COLUMNS)
    metrics_failed_by_topic = SqlTemplate(METRICS_FAILED_BY_TOPIC)
    last_event_id = SqlTemplate(LAST_EVENT_ID)
    discard_failed_by_id = SqlTemplate(DISCARD_FAILED_BY_ID)

    def __init__(self, table: str = DEFAULT_TABLE) -> None:
        schema, name = parse_table(table)
        self.table = table
        self.qualified = quote_table(schema, name)
        self.versions_table = quote_table(schema, VERSIONS_TABLE)
        self.channel = channel_for(table)
        slots = {
            "table": self.qualified,
            "table_literal": f"'{self.qualified}'",  # a validated name: no quote inside
            "wake_key": str(wake_lock_key(self.channel)),
            "versions": self.versions_table,
            "commit_named": _COMMIT_NAMED,
            "commit_positional": _COMMIT_POSITIONAL,
            "oversized": _oversized(""),
            "oversized_d": _oversized("d."),
            "oversized_error": _oversized_error("d."),
            "looped_error": _looped_error("d."),
            "event_columns": _EVENT_COLUMNS,
            "not_due": _NOT_DUE,
            "waiting_since": _WAITING_SINCE,
            **{state.name.lower(): str(int(state)) for state in Status},
        }
        self._render(slots)

    @functools.cached_property
    def migrations(self) -> dict[int, str]:
        """Each schema version's script for this table (backends/postgres/migrations/outbox/)."""
        return self.scripts("outbox")

    def scripts(self, kind: Kind) -> dict[int, str]:
        """Each version's script of ``kind`` (``outbox`` or ``partitioned``) for this table."""
        slots = schema_slots(self.table)
        return {f.version: f.render(slots) for f in migration_files(kind)}

    def ddl(self, *, partitioned: bool = False) -> str:
        """The whole schema as one script, for users who run their own migration tool."""
        scripts = self.scripts("partitioned") if partitioned else self.migrations
        parts = [scripts[v].strip() for v in sorted(scripts)]
        parts.append(self.create_version_table.strip() + ";")
        record = sql.SQL(
            "INSERT INTO {versions} (table_name, version) VALUES ({table}, {version})"
            " ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version;"
        ).format(
            versions=table_identifier(parse_table(self.table)[0], VERSIONS_TABLE),
            table=sql.Literal(self.table),
            version=sql.Literal(SCHEMA_VERSION),
        )
        parts.append(record.as_string(None))
        return "\n\n".join(parts) + "\n"


def numbered(statement: str, start: int = 1) -> str:
    """Turn psycopg's positional ``%s`` into PostgreSQL's ``$1, $2 ...`` (asyncpg)."""
    counter = iter(range(start, start + 1000))
    return re.sub(r"%s", lambda _m: f"${next(counter)}", statement)


def wake_lock_key(channel: str) -> int:
    """The advisory-lock key of an outbox's wake-up gate (WAKE_GATE): one per channel."""
    return zlib.crc32(f"outboxkit.wake:{channel}".encode())


def migration_lock_key(table: str) -> int:
    """A stable advisory-lock key per outbox table."""
    return zlib.crc32(f"outboxkit.migrate:{table}".encode())
