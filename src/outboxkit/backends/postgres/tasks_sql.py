"""Every SQL statement of task mode (a task table as a job queue), named, in one place.

As ``backends/postgres/postgres.py`` for the outbox: templates whose table slots are filled once per
table by :class:`TaskStatements` through the one identifier-quoting function; values always
travel as parameters. The claim, the lease in ``available_at`` and the token fencing every
settle are the outbox's (DESIGN.md §3 and §6b); what differs is named where it differs.
"""

from __future__ import annotations

import re
import uuid
import zlib
from collections.abc import Iterable, Sequence

from psycopg import sql

from outboxkit.backends.postgres.postgres import (
    _LOCK_NAMESPACE,
    LATER,
    TRY_WAKE_LOCK,
    WAKE_GATE,
    WAKE_UNLOCK,
    channel_for,
    numbered,
    parse_table,
    quote_table,
    table_identifier,
    wake_lock_key,
)
from outboxkit.queue.tasks import (
    DEFAULT_TASKS_TABLE,
    SUSPECT_LAPSES,
    TaskStatus,
)

#: Periodic tasks' slots, in the task table's schema.
SCHEDULES_TABLE = "outboxkit_schedules"


_STATES = {
    "pending": TaskStatus.PENDING,
    "running": TaskStatus.RUNNING,
    "done": TaskStatus.DONE,
    "failed": TaskStatus.FAILED,
    "cancelled": TaskStatus.CANCELLED,
    "waiting": TaskStatus.WAITING,
}


def deps_table_name(name: str) -> str:
    """The table of a task table's dependency edges: its name with ``_deps``."""
    return f"{name}_deps"[:63]


def queues_table_name(name: str) -> str:
    """The table of a task table's paused queues: its name with ``_queues``."""
    return f"{name}_queues"[:63]


def limits_table_name(name: str) -> str:
    """The table of a task table's rate-limit buckets: its name with ``_limits``."""
    return f"{name}_limits"[:63]


def key_rates_table_name(name: str) -> str:
    """The table of a task table's per-key rate-limit buckets: its name with ``_key_rates``."""
    return f"{name}_key_rates"[:63]


def fair_table_name(name: str) -> str:
    """The table of a task table's fair task names: its name with ``_fair``."""
    return f"{name}_fair"[:63]


def tasks_slots(table: str) -> dict[str, sql.Composable]:
    """The placeholders of the task table's migration files
    (backends/postgres/migrations/tasks/)."""
    schema, name = parse_table(table)
    return {
        "table": table_identifier(schema, name),
        "schedules": table_identifier(schema, SCHEDULES_TABLE),
        "queues": table_identifier(schema, queues_table_name(name)),
        "deps": table_identifier(schema, deps_table_name(name)),
        "limits": table_identifier(schema, limits_table_name(name)),
        "key_rates": table_identifier(schema, key_rates_table_name(name)),
        "fair": table_identifier(schema, fair_table_name(name)),
        "index_deps_after": sql.Identifier(f"{deps_table_name(name)}_after_idx"[:63]),
        "index_waiting": sql.Identifier(f"{name}_waiting_idx"[:63]),
        "index_key_waiting": sql.Identifier(f"{name}_key_waiting_idx"[:63]),
        "index_pending": sql.Identifier(f"{name}_claim_idx"[:63]),
        "index_unique": sql.Identifier(f"{name}_unique_idx"[:63]),
        "index_key": sql.Identifier(f"{name}_key_idx"[:63]),
        "index_failed": sql.Identifier(f"{name}_failed_idx"[:63]),
        "index_kept": sql.Identifier(f"{name}_kept_idx"[:63]),
        "index_running": sql.Identifier(f"{name}_running_idx"[:63]),
        # (DROP INDEX names it in the table's schema)
        "index_running_in_schema": table_identifier(schema, f"{name}_running_idx"[:63]),
        "index_parked": sql.Identifier(f"{name}_parked_idx"[:63]),
        "index_parked_in_schema": table_identifier(schema, f"{name}_parked_idx"[:63]),
        **{state: sql.Literal(int(value)) for state, value in _STATES.items()},
    }


# --- enqueue --------------------------------------------------------------------

# The columns an enqueue fills, in this order (tasks/ builds its parameters from it).
ENQUEUE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("task_name", "text"),
    ("queue", "text"),
    ("payload", "jsonb"),
    ("priority", "int2"),
    ("key", "text"),
    ("unique_key", "text"),
    ("max_attempts", "int4"),
    ("available_at", "timestamptz"),
    ("trace", "text"),
)
_COLUMNS = ", ".join(name for name, _ in ENQUEUE_COLUMNS)
# available_at takes two parameters: run_at (a time), or a delay in seconds added to the
# database's clock (an application host's clock may be off: leases and periodic tasks
# already use the database's).
_VALUES = ", ".join(
    "coalesce(%s::timestamptz, now() + make_interval(secs => %s::float8))"
    if name == "available_at"
    else f"%s::{pg_type}"
    for name, pg_type in ENQUEUE_COLUMNS
)
# A second live task with the same unique_key inserts nothing: ON CONFLICT waits for the
# transaction that holds the first one, then skips (it committed) or inserts (it rolled
# back: PostgreSQL's speculative insertion, so a rollback never loses the second).
# A keyed task first takes a transaction-scoped advisory lock on its key (the ordered
# outbox's KEY_LOCK, in the task table's namespace): the WHERE runs before the row takes its
# id, so two transactions enqueueing one key get their ids in their commit order, and the
# per-key serial claim runs them in that order.
# A keyed task enqueued behind a live task of its key waits (status waiting, after_failure
# NULL: for its key's turn, not for upstream tasks) outside the claim index: a key that
# floods 50 000 tasks then costs the claim nothing (it walked and skipped each of them:
# 64 ms a claim). Its key's head's settle makes the next one pending (PROMOTE_KEYS). The
# check runs after the key's advisory lock, on the statement's snapshot: an enqueue that
# raced its key's previous one inserts pending, and the claim's own per-key check keeps
# the order then. A task with a unique_key stays pending (the unique index covers only
# pending and running tasks).
# A fair name's task (a row in {fair}, kept by the workers) is pending at once while no
# task of its key waits (its key's order) and fewer than the name's share of its key are
# pending: what a promotion would do, without waiting for one (a key that enqueued faster
# than a claim round queued behind its own tasks). Its available_at is now: behind the
# tasks already due, as a promotion puts it.
_KEY_STATUS = """CASE WHEN v.key IS NOT NULL AND v.unique_key IS NULL
     AND (EXISTS (SELECT 1 FROM {table} AS h
                  WHERE h.key = v.key AND h.status = {waiting} AND h.after_failure IS NULL)
          OR (EXISTS (SELECT 1 FROM {table} AS h
                      WHERE h.key = v.key AND h.status IN ({pending}, {running}))
              AND coalesce((SELECT f.share > (SELECT count(*) FROM (
                                SELECT 1 FROM {table} AS h
                                WHERE h.key = v.key AND h.status = {pending}
                                LIMIT f.share) AS h)
                            FROM {fair} AS f WHERE f.task_name = v.task_name), false)
                  IS NOT TRUE))
     THEN {waiting} ELSE {pending} END"""
_INSERT = f"""
INSERT INTO {{table}} ({_COLUMNS}, status)
SELECT v.*, {_KEY_STATUS} FROM (VALUES ({_VALUES})) AS v({_COLUMNS})
WHERE v.key IS NULL
   OR (SELECT pg_advisory_xact_lock({_LOCK_NAMESPACE}, hashtext(v.key))) IS NOT NULL
ON CONFLICT (unique_key) WHERE status IN ({{pending}}, {{running}}) AND unique_key IS NOT NULL
DO NOTHING
"""
# One enqueue, one statement: the insert, and the wake-up of a waiting worker (the outbox's
# wake-up gate, WAKE_GATE: only while a worker waits): a task due now wakes it to claim, one
# due later says LATER (a parked worker, a fleet's idle database, learns its due time from
# it; a waiting one claims nothing for it). The result is the new task's id (NULL: a live
# task has the unique_key already, nothing inserted).
_WAKE_PAYLOAD = f"CASE WHEN available_at <= now() THEN '' ELSE '{LATER}' END"
ENQUEUE = (
    "WITH ins AS ("
    + _INSERT.strip()
    + """ RETURNING id, available_at)
SELECT CASE WHEN count(CASE WHEN """
    + WAKE_GATE
    + """
                            THEN pg_notify(%s, """
    + _WAKE_PAYLOAD
    + """) END) >= 0
            THEN max(id) END
FROM ins"""
)
# Tasks.transaction(): the same insert, prepared and sent with the COMMIT (write/commit.py's
# pipeline); it always notifies a waiting worker (the gate decides), due or not, and returns
# the new id (no row: a duplicate unique_key skipped), which tx.enqueue's handle takes.
ENQUEUE_WITH_COMMIT = (
    "WITH ins AS ("
    + _INSERT.strip()
    + " RETURNING id) SELECT ins.id, CASE WHEN "
    + WAKE_GATE
    + " THEN pg_notify(%s, '') END FROM ins"
)

# --- the worker -------------------------------------------------------------------

# The worker's own statements commit without waiting for the WAL flush (SET LOCAL, so no
# session state leaks through a transaction pooler): a claim or settle lost in a database
# crash only means a task runs again after its lease, which at-least-once allows. Waiting
# for the flush cost each task two fsyncs (~100 tasks/s on a slow disk). ctx.transaction()
# is the handler's own transaction and keeps the server's setting.
_NO_FLUSH_WAIT = "(SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL"

# available_at is both the run-at time and the lease: a claim marks a task running with
# its lease expiry there, so a worker that dies mid-task needs no rescuer: the task is
# claimable again when the lease runs out (status running, available_at <= now()).
# Per-key serial: a keyed task is claimable only while no earlier task of its key is
# live (pending or running), so at most its key's head runs, in enqueue order, across
# workers. Highest priority first, then the oldest due; one queue per statement, so the
# claim walks the claim index in its order and stops after one batch (no sort).
#
# A worker's death takes every task it ran with it, and only the one that killed it (a
# handler calling os._exit, a segfault in a C extension) deserves the charge. So a lapsed
# task's attempt counts against max_attempts only when its claim ran it alone: a death
# beside others is `spared` (the attempt keeps its number, but is not charged), and
# `lapses` counts such deaths in a row. From SUSPECT_LAPSES on the task is a suspect,
# taken only by a claim that runs it alone (`alone`, queue/task_claims.py), so its next
# death is its own. A claim that is not alone passes over suspects and says so (a row
# with a NULL id): the worker drains and runs them alone (queue/tasks.py).
#
# Concurrency limits (`@tasks.handler(name, concurrency=N)`): the running tasks of a
# limited name ARE its slots. A claim of a limited name (`name`, `concurrency`) takes at most
# N minus its running tasks whose lease has not lapsed, counted on the running index
# (0007_limits.sql); every other claim skips the limited names (`skip`). Claims of one
# limited name serialize on CLAIM_LIMIT_LOCK, taken by a statement of its own in the claim's
# transaction, so the count's snapshot (the claim statement's, taken after the lock) sees
# every claim of that name that committed before: two workers never both fill the last
# slot. Nothing else needs the lock: a settle only empties a slot (fenced by the claim
# token: a zombie's settle of a task claimed again since changes nothing), and a lapsed
# lease stops counting by the clock alone (a SIGKILLed worker's slots free then), while
# EXTEND never revives a lapsed lease (the slot may be taken by then). A full limit makes
# the claim's LIMIT 0: it reads nothing of the tasks waiting behind it.
#
# The crash-loop guard (as the outbox's): a claimable task whose charged attempts
# (attempts - spared) reached max_attempts was never settled by the worker that held it
# last (each one died running it). The claim dead-letters it with an error that says so
# and returns it with that error last.
# A keyed task's turn: its key's head (no earlier live task of its key) in every claim but
# that of a name with `concurrency_per_key=N`, whose keyed tasks run while fewer than N
# earlier tasks of their key are live: a key's first N live tasks, in id order. No lock is
# needed: a claim turns pending into running, both live, so no claim changes which tasks
# are a key's first N; only a settle (or a cancel) takes one out, and a promotion
# (PROMOTE_KEYS) adds the next ones with higher ids. A lapsed task stays live: it holds its
# place until it is claimed again and settled (a SIGKILLed worker's slot frees with its
# lease, for the task it held); a zombie's settle is fenced and frees nothing.
# A fair name's claim (`fair`, `@tasks.handler(name, fair=True)`) takes any pending task of
# the name: how many of a key run is not its business, how many of a key are pending is
# the promotion's (at most FAIR_SHARE, each promoted behind the tasks already due).
_KEY_HEAD = """      AND (t.key IS NULL OR NOT EXISTS (
          SELECT 1 FROM {table} AS e
          WHERE e.key = t.key AND e.id < t.id AND e.status IN ({pending}, {running})))
"""
_KEY_TURN = """      AND (t.key IS NULL OR %(fair)s::bool OR (
          SELECT count(*) FROM (SELECT 1 FROM {table} AS e
                                WHERE e.key = t.key AND e.id < t.id
                                  AND e.status IN ({pending}, {running})
                                LIMIT %(per_key)s) AS e) < %(per_key)s)
"""
# Rate limits per key (`rate_per_key="5/s"`): a bucket per (name, key) in {key_rates},
# refilled by the database's clock like the name's own (a key without a row: a full
# bucket). The walk passes keyed tasks whose key's bucket holds no token (a primary-key
# probe each: at most a key's first `concurrency_per_key` live tasks are pending, the rest
# wait out of the claim index); the batch takes at most the floor of a key's tokens of its
# tasks, oldest first, and the spend writes each key's bucket back. The name's claims
# serialize on CLAIM_LIMIT_LOCK, so two workers never spend one token. Unkeyed tasks have
# no key's bucket: the per-key rate leaves them be.
_KEY_TOKENS = """coalesce(
               (SELECT least(%(key_burst)s::float8,
                             b.tokens + extract(epoch FROM now() - b.at)::float8
                                        * %(key_rate)s::float8)
                FROM {key_rates} AS b WHERE b.task_name = %(name)s::text AND b.key = t.key),
               %(key_burst)s::float8)"""
_KEY_RATE_SEEN = (
    """,
           t.key, CASE WHEN %(key_rate)s::float8 IS NOT NULL AND t.key IS NOT NULL
                       THEN """
    + _KEY_TOKENS
    + """ END AS key_tokens"""
)
_KEY_RATE_WALK = (
    """      AND (%(key_rate)s::float8 IS NULL OR t.key IS NULL OR """
    + _KEY_TOKENS
    + """ >= 1)
"""
)
_BATCH = """    SELECT * FROM seen WHERE (lapses >= {suspect}) = %(alone)s
"""
_KEY_RATE_BATCH = """    SELECT * FROM (
        SELECT s.*, row_number() OVER (PARTITION BY s.key ORDER BY s.id) AS turn
        FROM seen AS s WHERE (s.lapses >= {suspect}) = %(alone)s) AS x
    WHERE x.key_tokens IS NULL OR x.turn <= floor(x.key_tokens)
"""
_KEY_RATE_SPENT = """), key_spent AS (
    INSERT INTO {key_rates} AS k (task_name, key, tokens, at, rate, burst)
    SELECT %(name)s::text, s.key, min(s.key_tokens) - count(*), now(), %(key_rate)s::float8,
           %(key_burst)s::float8
    FROM claimed AS c JOIN seen AS s ON s.id = c.id
    WHERE s.key_tokens IS NOT NULL
    GROUP BY s.key
    ON CONFLICT (task_name, key) DO UPDATE
    SET tokens = EXCLUDED.tokens, at = EXCLUDED.at, rate = EXCLUDED.rate, burst = EXCLUDED.burst
"""
CLAIM = """
WITH bucket AS MATERIALIZED (
    SELECT least(%(burst)s::float8,
                 b.tokens + extract(epoch FROM now() - b.at)::float8 * %(rate)s::float8) AS tokens
    FROM {limits} AS b WHERE b.task_name = %(name)s::text AND %(rate)s::float8 IS NOT NULL
), seen AS MATERIALIZED (
    SELECT t.id, t.attempts - t.spared AS charged,
           coalesce(t.max_attempts, %(max_attempts)s) AS max_attempts,
           t.status = {running} AND t.lapses < {suspect} AS ambiguous,
           t.lapses + CASE WHEN t.status = {running} AND t.lapses < {suspect} THEN 1 ELSE 0
                      END AS lapses{key_rate_seen}
    FROM {table} AS t
    WHERE t.status IN ({pending}, {running}) AND t.available_at <= now()
      AND t.queue = %(queue)s
      AND (%(names)s::text[] IS NULL OR t.task_name = ANY(%(names)s::text[]))
      AND (%(name)s::text IS NULL OR t.task_name = %(name)s::text)
      AND NOT t.task_name = ANY(%(skip)s::text[])
{key_turn}{key_rate_walk}      AND (NOT %(alone)s
           OR t.lapses + CASE WHEN t.status = {running} THEN 1 ELSE 0 END >= {suspect})
      AND NOT EXISTS (SELECT 1 FROM {queues} AS q WHERE q.queue = %(queue)s AND q.paused)
    ORDER BY t.priority DESC, t.available_at, t.id
    LIMIT greatest(0, least(
        %(limit)s::int4,
        CASE WHEN %(concurrency)s::int4 IS NOT NULL THEN %(concurrency)s::int4 - (
            SELECT count(*) FROM {table} AS r
            WHERE r.task_name = %(name)s::text AND r.status = {running}
              AND r.available_at > now())::int4 END,
        CASE WHEN %(rate)s::float8 IS NOT NULL
             THEN coalesce(floor((SELECT tokens FROM bucket))::int4, 0) END))
    FOR UPDATE OF t SKIP LOCKED
), batch AS (
{key_rate_batch}), dead AS (
    UPDATE {table} AS d
    SET status = {failed}, claim_token = NULL, claimed_by = %(owner)s, finished_at = now(),
        error_type = 'CrashLoop',
        last_error = 'worker: claimed ' || d.attempts || ' times without finishing (each'
                     || ' worker died or hung running it): dead-lettered unread; see'
                     || ' `outboxkit tasks failed`, then replay or discard it'
    WHERE d.id = ANY(ARRAY(SELECT id FROM batch
                           WHERE NOT ambiguous AND charged >= max_attempts))
    RETURNING d.id, d.task_name, d.queue, d.payload, d.attempts, d.max_attempts, d.key,
              d.priority, d.created_at, d.spared, d.has_dependents, d.trace, d.last_error
), claimed AS (
    -- (o's columns are the row as the batch locked it: the same lapse rule as `seen`)
    UPDATE {table} AS o
    SET status = {running}, attempts = o.attempts + 1,
        lapses = o.lapses + CASE WHEN o.status = {running} AND o.lapses < {suspect}
                                 THEN 1 ELSE 0 END,
        spared = o.spared + CASE WHEN o.status = {running} AND o.lapses < {suspect}
                                 THEN 1 ELSE 0 END,
        available_at = now() + make_interval(secs => %(lease)s),
        claim_token = %(token)s, claimed_by = %(owner)s, started_at = now()
    WHERE o.id = ANY(ARRAY(SELECT id FROM batch WHERE ambiguous OR charged < max_attempts))
      AND {no_flush_wait}
    RETURNING o.id, o.task_name, o.queue, o.payload, o.attempts, o.max_attempts, o.key,
              o.priority, o.created_at, o.spared, o.has_dependents, o.trace, NULL::text
), spent AS (
    UPDATE {limits} AS s
    SET tokens = (SELECT tokens FROM bucket) - (SELECT count(*) FROM claimed), at = now()
    WHERE s.task_name = %(name)s::text AND %(rate)s::float8 IS NOT NULL
{key_rate_spent})
SELECT * FROM claimed UNION ALL SELECT * FROM dead
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE EXISTS (SELECT 1 FROM seen WHERE (lapses >= {suspect}) <> %(alone)s)
"""
_CLAIM_PARTS = {
    "{key_turn}": (_KEY_TURN, _KEY_HEAD),
    "{key_rate_seen}": (_KEY_RATE_SEEN, ""),
    "{key_rate_walk}": (_KEY_RATE_WALK, ""),
    "{key_rate_batch}": (_KEY_RATE_BATCH, _BATCH),
    "{key_rate_spent}": (_KEY_RATE_SPENT, ""),
}
for _slot, (_limited, _plain) in _CLAIM_PARTS.items():
    CLAIM = CLAIM.replace(_slot, _limited)
# A worker claims only the task names it has handlers for (a rolling deploy's newer names
# wait for the workers that have them). A due task that no worker claimed for `grace`
# seconds has no worker anywhere: the workers that lack its name fail it, a batch at a time.
FAIL_UNHANDLED = """
UPDATE {table} AS t
SET status = {failed}, finished_at = now(), claim_token = NULL, error_type = 'UnknownTask',
    last_error = 'no worker with a handler for task ' || t.task_name || ' claimed it within '
                 || %(grace)s || ' s of its due time: deploy a worker whose --app registers'
                 || ' it, then `outboxkit tasks replay`'
WHERE t.id = ANY(ARRAY(
    SELECT id FROM {table}
    WHERE status = {pending} AND queue = ANY(%(queues)s::text[])
      AND available_at < now() - make_interval(secs => %(grace)s)
      AND NOT (task_name = ANY(%(names)s::text[]))
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED))
RETURNING t.task_name
"""
# Every settle is fenced by the claim token: a task another claim took since (its lease ran
# out) is left alone, and the ids returned say which were settled.
SETTLE_DONE_DELETE = (
    "DELETE FROM {table} WHERE id = ANY(%s) AND claim_token = %s AND {no_flush_wait} RETURNING id"
)
SETTLE_DONE_KEEP = """
UPDATE {table}
SET status = {done}, finished_at = now(), claim_token = NULL
WHERE id = ANY(%s) AND claim_token = %s AND {no_flush_wait}
RETURNING id
"""
# Several claims' completions in one statement (the worker's split claims settle one task
# each: settles waiting for the connection are grouped), each fenced by its own token.
# The two arrays travel as array literals (done_arrays()): psycopg's list dumper costs
# about 6 us per element in Python, the server's parse of the text almost nothing.
SETTLE_DONE_MANY_DELETE = """
DELETE FROM {table} AS t USING unnest(%s::bigint[], %s::uuid[]) AS u(id, token)
WHERE t.id = u.id AND t.claim_token = u.token AND {no_flush_wait}
RETURNING t.id
"""
SETTLE_DONE_MANY_KEEP = """
UPDATE {table} AS t
SET status = {done}, finished_at = now(), claim_token = NULL
FROM unnest(%s::bigint[], %s::uuid[]) AS u(id, token)
WHERE t.id = u.id AND t.claim_token = u.token AND {no_flush_wait}
RETURNING t.id
"""
# Retries, dead letters and hand-backs of one claim in one statement. A handed-back task
# (Snooze, shutdown) gets its attempt back (`refund`); a NULL error keeps the last one.
SETTLE_FAILURES = """
UPDATE {table} AS o
SET status = u.next_status,
    available_at = now() + make_interval(secs => u.delay),
    last_error = coalesce(u.error, o.last_error),
    error_type = coalesce(u.error_type, o.error_type),
    traceback_excerpt = coalesce(u.traceback, o.traceback_excerpt),
    claim_token = NULL,
    attempts = greatest(o.attempts - u.refund, 0),
    lapses = CASE WHEN u.refund = 1 THEN o.lapses ELSE 0 END,
    finished_at = CASE WHEN u.next_status = {failed} THEN now() END
FROM unnest(%s::bigint[], %s::smallint[], %s::float8[], %s::text[], %s::int[], %s::text[],
            %s::text[]) AS u(id, next_status, delay, error, refund, error_type, traceback)
WHERE o.id = u.id AND o.claim_token = %s AND {no_flush_wait}
RETURNING o.id
"""
# ctx.transaction(): the last statement of the handler's own transaction completes its task,
# fenced by the token. No row: the lease was lost, and the caller rolls everything back.
COMPLETE_DELETE = "DELETE FROM {table} WHERE id = %s AND claim_token = %s RETURNING id"
COMPLETE_KEEP = """
UPDATE {table}
SET status = {done}, finished_at = now(), claim_token = NULL
WHERE id = %s AND claim_token = %s
RETURNING id
"""
# ... and for a task whose handler keeps its result: the row stays, done, until keep_until;
# its result follows once the handler has returned (SET_RESULT), which wakes the waiters.
COMPLETE_KEPT = """
UPDATE {table}
SET status = {done}, finished_at = now(), claim_token = NULL,
    keep_until = now() + make_interval(secs => %s), progress = coalesce(%s::jsonb, progress)
WHERE id = %s AND claim_token = %s
RETURNING id
"""

# --- results and progress ----------------------------------------------------------

# Completions that keep their results: each row done with its value (JSON text) until
# keep_until, with its last progress not written yet, fenced by its own claim's token, and
# a notification per task on the results channel (its id) for whoever waits on it
# (Tasks.wait). Finished tasks of handlers that keep nothing are deleted (or kept without a
# result) and notify nobody, as before.
SETTLE_DONE_RESULTS = """
WITH done AS (
    UPDATE {table} AS t
    SET status = {done}, finished_at = now(), claim_token = NULL, result = u.result::jsonb,
        keep_until = now() + make_interval(secs => u.keep),
        progress = coalesce(u.progress::jsonb, t.progress)
    FROM unnest(%s::bigint[], %s::uuid[], %s::text[], %s::float8[], %s::text[])
         AS u(id, token, result, keep, progress)
    WHERE t.id = u.id AND t.claim_token = u.token AND {no_flush_wait}
    RETURNING t.id
)
SELECT id, pg_notify(%s, id::text) FROM done
"""
# The result of a task its handler completed in ctx.transaction(): written after that
# transaction committed (the value exists only once the handler returned). Not fenced by a
# token (the completion cleared it), but by the attempt that completed it: no other attempt
# runs a done task.
SET_RESULT = """
WITH kept AS (
    UPDATE {table} SET result = %s::jsonb
    WHERE id = %s AND attempts = %s AND status = {done} AND result IS NULL
      AND {no_flush_wait}
    RETURNING id
)
SELECT id, pg_notify(%s, id::text) FROM kept
"""
# Dead letters of handlers that keep results wake their waiters too (the failure is the
# result: Tasks.wait returns it).
NOTIFY_RESULTS = "SELECT pg_notify(%s, i::text) FROM unnest(%s::bigint[]) AS i"
# ctx.progress(): the running attempt's last reported values, written together (a
# worker's flush every so often), each fenced by its claim token: a zombie's progress
# matches no row.
SET_PROGRESS = """
UPDATE {table} AS t SET progress = u.progress::jsonb
FROM unnest(%s::bigint[], %s::uuid[], %s::text[]) AS u(id, token, progress)
WHERE t.id = u.id AND t.claim_token = u.token AND t.status = {running} AND {no_flush_wait}
"""
# A task as Tasks.result() reads it: its state (a pending task not yet due is scheduled),
# value, error, progress and timings.
READ_RESULT = """
SELECT id, task_name, status, available_at > now() AS later, result, last_error, error_type,
       traceback_excerpt, attempts, progress, created_at, started_at, finished_at
FROM {table} WHERE id = %s
"""
# Kept results past their keep_until leave in small batches (the worker's maintenance).
PURGE_KEPT = """
DELETE FROM {table} WHERE id = ANY(ARRAY(
    SELECT id FROM {table}
    WHERE keep_until < now() AND status IN ({done}, {cancelled})
    LIMIT %s))
"""

# Per-key buckets that have refilled (a key not started for a while) are the same as no
# row: deleted a batch at a time by the workers' maintenance, by each row's own rate and
# burst. A claim that spends the bucket meanwhile rewrites the row, which then no longer
# matches (the delete reads the row again once its lock is free).
PRUNE_KEY_RATES = """
DELETE FROM {key_rates} AS b
WHERE (b.task_name, b.key) IN (
    SELECT f.task_name, f.key FROM {key_rates} AS f
    WHERE f.tokens + extract(epoch FROM now() - f.at)::float8 * f.rate >= f.burst
    LIMIT %s)
  AND b.tokens + extract(epoch FROM now() - b.at)::float8 * b.rate >= b.burst
"""

# --- dependencies (enqueue(after=[...])) ---------------------------------------------

# An enqueue with upstream tasks: marks them as having dependents (taking their row locks,
# so a worker completing one waits for this transaction), refuses an unknown one (the cast
# fails the statement: nothing is written and the caller's transaction says why), inserts
# the task waiting unless every upstream task is done already, and its edges. An upstream
# task that is done and deleted is unknown here: enqueue dependents in the transaction that
# enqueues their upstream tasks, or give those keep_result (docs/tasks.md).
ENQUEUE_AFTER = (
    """WITH up AS MATERIALIZED (
    UPDATE {table} SET has_dependents = true
    WHERE id = ANY(%(after)s::bigint[])
    RETURNING id, status
), guard AS MATERIALIZED (
    SELECT CASE WHEN count(*) = cardinality(%(after)s::bigint[]) THEN 0 ELSE
        ('outboxkit: no upstream task ' || (
            SELECT string_agg(a::text, ', ') FROM unnest(%(after)s::bigint[]) AS a
            WHERE a NOT IN (SELECT id FROM up)))::int END AS missing
    FROM up
), ins AS (
    INSERT INTO {table} ("""
    + _COLUMNS
    + """, status, after_failure)
    SELECT v.*, CASE WHEN EXISTS (SELECT 1 FROM up WHERE up.status <> {done})
                     THEN {waiting} ELSE {pending} END,
           %(after_failure)s::int2
    FROM (VALUES ("""
    + ", ".join(
        "coalesce(%(run_at)s::timestamptz, now() + make_interval(secs => %(delay)s::float8))"
        if name == "available_at"
        else f"%({name})s::{pg_type}"
        for name, pg_type in ENQUEUE_COLUMNS
    )
    + """)) AS v("""
    + _COLUMNS
    + """)
    WHERE (SELECT missing FROM guard) = 0
      AND (v.key IS NULL
           OR (SELECT pg_advisory_xact_lock("""
    + str(_LOCK_NAMESPACE)
    + """, hashtext(v.key))) IS NOT NULL)
    ON CONFLICT (unique_key) WHERE status IN ({pending}, {running}) AND unique_key IS NOT NULL
    DO NOTHING
    RETURNING id, status, available_at
), edges AS (
    INSERT INTO {deps} (task_id, after_id) SELECT ins.id, up.id FROM ins, up
)
SELECT CASE WHEN count(CASE WHEN status = {pending} AND """
    + WAKE_GATE
    + """
                            THEN pg_notify(%(channel)s, """
    + _WAKE_PAYLOAD
    + """) END) >= 0
            THEN max(id) END
FROM ins"""
)
# The dependents of the given upstream tasks (NULL: every waiting task, the sweep) whose
# fate is decided: every upstream task finished (done, or deleted when done) makes one
# pending; a failed or cancelled upstream task cancels one whose after_failure is 0 (with
# a reason naming it) and counts as finished for one that runs anyway. Run right after a
# settle that finished tasks with dependents (a new statement: it sees every commit before
# it, so of two upstream tasks finishing at once the later release sees both), and by
# each worker's sweep (an enqueue racing its upstream's completion). Locked in id order,
# waiting for a concurrent release, so exactly one moves each task.
RELEASE_DEPENDENTS = """
WITH cand AS MATERIALIZED (
    SELECT t.id FROM {table} AS t
    WHERE t.status = {waiting} AND t.after_failure IS NOT NULL  -- (the waiting index)
      AND (%(ids)s::bigint[] IS NULL
           OR t.id IN (SELECT d.task_id FROM {deps} AS d WHERE d.after_id = ANY(%(ids)s)))
    ORDER BY t.id
    LIMIT %(limit)s
    FOR UPDATE OF t
), state AS (
    SELECT c.id,
           count(u.id) FILTER (WHERE u.status IN ({pending}, {running}, {waiting})) AS live,
           min(d.after_id) FILTER (WHERE u.status IN ({failed}, {cancelled})) AS bad
    FROM cand AS c
    JOIN {deps} AS d ON d.task_id = c.id
    LEFT JOIN {table} AS u ON u.id = d.after_id
    GROUP BY c.id
), moved AS (
    UPDATE {table} AS t
    SET status = CASE WHEN s.bad IS NOT NULL AND t.after_failure = 0 THEN {cancelled}
                      ELSE {pending} END,
        finished_at = CASE WHEN s.bad IS NOT NULL AND t.after_failure = 0 THEN now() END,
        error_type = CASE WHEN s.bad IS NOT NULL AND t.after_failure = 0
                          THEN 'UpstreamFailed' END,
        last_error = CASE WHEN s.bad IS NOT NULL AND t.after_failure = 0
                          THEN 'upstream task ' || s.bad || ' failed or was cancelled, so this'
                               || ' task was cancelled (after_failure="cancel")' END
    FROM state AS s
    WHERE t.id = s.id AND t.status = {waiting}
      AND ((s.bad IS NOT NULL AND t.after_failure = 0) OR s.live = 0)
    RETURNING t.id, t.status
)
SELECT id, status,
       CASE WHEN status = {pending} THEN pg_notify(%(channel)s, '') END,
       CASE WHEN status = {cancelled} THEN pg_notify(%(results)s, id::text) END
FROM moved
"""
# The next waiting tasks of each given key become pending while its key has room: a key's
# live tasks plus a waiting task's turn among its key's waiting ones (1, 2, ...) at most its
# name's `concurrency_per_key` (`per_key_names` / `per_key`, the worker's; 1 for any other
# name: the next one once its key has no live task). Run after a settle that ended a keyed
# task and after a claim of keyed tasks of a name with N > 1 (a statement of its own, so it
# sees that commit). Two promotions of one key race for the same first waiting tasks (the
# row lock, then `status = waiting` again): neither adds more than the room it saw.
# `most`: the largest N, which bounds what each key's probes read.
# A fair name's (`fair_names`) room is `fair_share` minus its key's *pending* tasks (the
# running ones do not count), and a task it promotes goes behind every task already due
# (available_at moved to now) unless it is its key's only pending one (its key's turn: it
# keeps its place, so a key that enqueues one task at a time is not sent to the back each
# time): the claim, ordered by time, then sees at most `fair_share` of a key ahead of any
# task due before the promotion, one of them older. The pending count reads the
# key's live rows (running ones too: at most the workers' slots and prefetch), only when
# the worker has fair names.
_PROMOTE = """
UPDATE {table} AS t SET status = {pending},
    available_at = CASE WHEN n.behind THEN greatest(t.available_at, now()) ELSE t.available_at END
FROM (
    SELECT w.id, w.fair AND (q.pending > 0 OR w.turn > 1) AS behind FROM {keys} AS k(key)
    CROSS JOIN LATERAL (
        SELECT count(*) AS live FROM (SELECT 1 FROM {table} AS e
                                      WHERE e.key = k.key AND e.status IN ({pending}, {running})
                                      LIMIT %(most)s) AS e) AS l
    CROSS JOIN LATERAL (
        SELECT count(*) AS pending FROM (SELECT 1 FROM {table} AS e
                                         WHERE e.key = k.key AND e.status = {pending}
                                           AND cardinality(%(fair_names)s::text[]) > 0
                                         LIMIT %(fair_share)s) AS e) AS q
    CROSS JOIN LATERAL (
        SELECT w.id, w.task_name, w.task_name = ANY(%(fair_names)s::text[]) AS fair,
               row_number() OVER (ORDER BY w.id) AS turn
        FROM {table} AS w
        WHERE w.key = k.key AND w.status = {waiting} AND w.after_failure IS NULL
        ORDER BY w.id LIMIT %(most)s) AS w
    WHERE CASE WHEN w.fair THEN q.pending + w.turn <= %(fair_share)s
               ELSE l.live + w.turn <= coalesce(
                   (SELECT p.n FROM unnest(%(per_key_names)s::text[], %(per_key)s::int4[])
                                    AS p(name, n)
                    WHERE p.name = w.task_name), 1) END
) AS n
WHERE t.id = n.id AND t.status = {waiting}
RETURNING t.id, t.key, pg_notify(%(channel)s, '')
"""
PROMOTE_KEYS = _PROMOTE.replace("{keys}", "unnest(%(keys)s::text[])")
# The sweep's side of it: keys with waiting tasks and room (an enqueue that raced its
# head's settle, a worker killed between a settle and its promotion, a head cancelled, a
# task enqueued behind fewer than N running ones of its key, a fair key whose pending ones
# were claimed), found by a skip scan of the keys (one probe a key, not one a task).
SWEEP_KEYS = """WITH RECURSIVE keys(k) AS (
    (SELECT key FROM {table}
     WHERE status = {waiting} AND after_failure IS NULL AND key IS NOT NULL
     ORDER BY key LIMIT 1)
    UNION ALL
    SELECT (SELECT w.key FROM {table} AS w
            WHERE w.status = {waiting} AND w.after_failure IS NULL AND w.key > keys.k
            ORDER BY w.key LIMIT 1)
    FROM keys WHERE keys.k IS NOT NULL
), stuck AS (
    SELECT k FROM keys
    CROSS JOIN LATERAL (SELECT w.task_name AS name FROM {table} AS w
                        WHERE w.key = keys.k AND w.status = {waiting}
                          AND w.after_failure IS NULL
                        ORDER BY w.id LIMIT 1) AS f
    WHERE k IS NOT NULL
      AND CASE WHEN f.name = ANY(%(fair_names)s::text[])
          THEN (SELECT count(*) FROM (SELECT 1 FROM {table} AS e
                                      WHERE e.key = keys.k AND e.status = {pending}
                                      LIMIT %(fair_share)s) AS e) < %(fair_share)s
          ELSE (SELECT count(*) FROM (SELECT 1 FROM {table} AS e
                                      WHERE e.key = keys.k AND e.status IN ({pending}, {running})
                                      LIMIT %(most)s) AS e)
               < coalesce((SELECT p.n
                           FROM unnest(%(per_key_names)s::text[], %(per_key)s::int4[])
                                AS p(name, n)
                           WHERE p.name = f.name), 1) END
    LIMIT %(limit)s
)""" + _PROMOTE.replace("{keys}", "stuck")
# Tasks behind a full concurrency limit wait out of the claim index (task table version 10).
# A worker with a limited name's handler keeps `keep` (the name's N) of its unkeyed tasks
# pending in a queue, the first ones in the claim's order with those due first, and parks
# the rest: status waiting, key and after_failure NULL (keyed tasks wait by their keys, a
# dependent by its upstream tasks, a unique_key's task stays pending: the unique index
# covers live states only). The claim then walks N of the name, not 100 000. A claim of
# the name that took c tasks promotes the c first parked ones that are due, in its own
# transaction under the name's lock (so the N pending are always the best N: the claim
# takes at most N minus the running ones); the sweep promotes the first N due and parks
# again whatever is beyond N (a parked task come due, a retry, an enqueue since). A lapse
# or a settle changes no parked task: a SIGKILLed worker's tasks stay running (claimable
# at their lease's end, in the claim index), a zombie's settle is fenced. Nothing here
# decides how many run: the claim's count of the running ones does. Parked tasks of a
# name whose handler has no limit any more are promoted by the sweep (UNPARK_NAMES).
_PARKED = "{a}.status = {{waiting}} AND {a}.key IS NULL AND {a}.after_failure IS NULL"
PARK_NAME = """
UPDATE {table} AS t SET status = {waiting}
WHERE t.id = ANY(ARRAY(
    SELECT p.id FROM {table} AS p
    WHERE p.status = {pending} AND p.queue = %(queue)s AND p.task_name = %(name)s
      AND p.key IS NULL AND p.unique_key IS NULL AND p.after_failure IS NULL
    ORDER BY p.available_at > now(), p.priority DESC, p.available_at, p.id
    OFFSET %(keep)s LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED))
  AND t.status = {pending}
"""
_UNPARK = """
UPDATE {{table}} AS t SET status = {{pending}}
WHERE t.id = ANY(ARRAY(
    SELECT w.id FROM {{table}} AS w
    WHERE {parked_w} AND {which}
    LIMIT %({count})s
    FOR UPDATE SKIP LOCKED))
  AND {parked_t}
"""
PROMOTE_NAME = _UNPARK.format(
    parked_w=_PARKED.format(a="w"),
    parked_t=_PARKED.format(a="t"),
    which="""w.task_name = %(name)s AND w.queue = %(queue)s
      AND w.available_at <= now()
    ORDER BY w.priority DESC, w.available_at, w.id""",
    count="count",
)
UNPARK_NAMES = _UNPARK.format(
    parked_w=_PARKED.format(a="w"),
    parked_t=_PARKED.format(a="t"),
    which="w.task_name = ANY(%(names)s::text[])",
    count="limit",
)
# ctx.dependencies(): the upstream tasks of a task, as Tasks.result() reads one (a done
# upstream task whose row was deleted comes back as its id alone).
READ_DEPENDENCIES = """
SELECT d.after_id, u.id, u.task_name, u.status, u.available_at > now() AS later, u.result,
       u.last_error, u.error_type, u.traceback_excerpt, u.attempts, u.progress, u.created_at,
       u.started_at, u.finished_at
FROM {deps} AS d LEFT JOIN {table} AS u ON u.id = d.after_id
WHERE d.task_id = %s
ORDER BY d.after_id
"""
# Edges of tasks that are gone (done and deleted, purged, discarded), a batch at a time.
PRUNE_EDGES = """
DELETE FROM {deps} WHERE task_id = ANY(ARRAY(
    SELECT DISTINCT d.task_id FROM {deps} AS d
    WHERE NOT EXISTS (SELECT 1 FROM {table} AS t WHERE t.id = d.task_id)
    LIMIT %s))
"""

# At shutdown: tasks not finished go back at once, their attempt refunded.
RELEASE = """
UPDATE {table}
SET status = {pending}, available_at = now(), claim_token = NULL,
    attempts = greatest(attempts - 1, 0)
WHERE id = ANY(%s) AND claim_token = %s AND {no_flush_wait}
"""
# The heartbeat: a running task's lease pushed to now + lease, by the database's clock. A
# lapsed lease stays lapsed (the task is claimable, and its concurrency slot may be filled
# by another task already): a late heartbeat never makes two tasks hold one slot.
EXTEND = """
UPDATE {table}
SET available_at = now() + make_interval(secs => %s)
WHERE id = ANY(%s) AND claim_token = %s AND status = {running} AND available_at > now()
  AND {no_flush_wait}
"""
# The claims of one limited task name, one at a time (see CLAIM): a transaction-scoped lock
# in the bigint key space (the per-key enqueue lock uses the two-int4 one).
CLAIM_LIMIT_LOCK = (
    "SELECT pg_advisory_xact_lock(hashtextextended({table_literal} || '/limit/' || %s, 0))"
)
# A rate-limited name's bucket, made full at its first claim (after CLAIM_LIMIT_LOCK).
CLAIM_BUCKET = """
INSERT INTO {limits} (task_name, tokens, at) VALUES (%s, %s, now())
ON CONFLICT (task_name) DO NOTHING
"""
HASTEN = """
UPDATE {table}
SET available_at = now()
WHERE id = ANY(%s) AND status = {pending} AND claim_token IS NULL AND available_at > now()
"""
COUNT_PENDING = """
SELECT count(*) FROM (SELECT 1 FROM {table} WHERE status = {pending} LIMIT %s) AS p
"""
# At start: is the table vacuumed? Each task leaves dead row versions (its claim's, its
# delete's or purge's); without autovacuum (server-wide `autovacuum = off`, or the table's
# autovacuum_enabled = false) nothing reclaims them and the table and its claim grow
# without bound (docs/tasks.md, "Table health"). NULL: it is; else what turned it off.
AUTOVACUUM_OFF = """
SELECT CASE
    WHEN NOT current_setting('autovacuum')::bool THEN 'the server runs with autovacuum = off'
    WHEN EXISTS (SELECT 1 FROM unnest(c.reloptions) AS o
                 WHERE split_part(o, '=', 1) = 'autovacuum_enabled'
                   AND NOT split_part(o, '=', 2)::bool)
        THEN 'the table has autovacuum_enabled = false'
    END
FROM pg_class AS c WHERE c.oid = {table_literal}::regclass
"""
TASK_STATE = "SELECT status, attempts, last_error FROM {table} WHERE id = %s"
# At start: the columns and tables of the latest schema version are there (an older table
# fails here, naming what is missing, instead of at the first claim).
CHECK_COLUMNS = """
SELECT lapses, spared, result, progress, keep_until, has_dependents, after_failure, trace,
       (SELECT 1 FROM {queues} LIMIT 0), (SELECT 1 FROM {deps} LIMIT 0),
       (SELECT 1 FROM {limits} LIMIT 0), (SELECT 1 FROM {key_rates} LIMIT 0),
       (SELECT 1 FROM {fair} LIMIT 0)
FROM {table} LIMIT 0
"""

# A worker's fair names and their share, written at its first claim; the names it handles
# without fair= deleted (a deploy that took fair= away: its enqueues wait for promotions again).
TELL_FAIR = """
WITH gone AS (
    DELETE FROM {fair} WHERE task_name = ANY(%(plain)s::text[])
)
INSERT INTO {fair} (task_name, share) SELECT n, %(share)s FROM unnest(%(fair)s::text[]) AS n
ON CONFLICT (task_name) DO UPDATE SET share = EXCLUDED.share, at = now()
WHERE {fair}.share <> EXCLUDED.share
"""

# --- paused queues ---------------------------------------------------------------------

# Pausing a queue is one row; its claims pass it over from their next statement. Resuming
# wakes the waiting workers at once (the queue's tasks may have been due for a while). Both
# return the queue's state before (NULL: never paused), so a repeat says so.
PAUSE_QUEUE = """
WITH before AS (SELECT paused FROM {queues} WHERE queue = %(queue)s)
INSERT INTO {queues} (queue, paused, changed_at, changed_by)
VALUES (%(queue)s, true, now(), %(by)s)
ON CONFLICT (queue) DO UPDATE
SET paused = true, changed_at = now(), changed_by = EXCLUDED.changed_by
RETURNING (SELECT paused FROM before)
"""
RESUME_QUEUE = """
WITH before AS (SELECT paused FROM {queues} WHERE queue = %(queue)s),
     resumed AS (
    UPDATE {queues} SET paused = false, changed_at = now(), changed_by = %(by)s
    WHERE queue = %(queue)s AND paused
    RETURNING 1
)
SELECT (SELECT paused FROM before), pg_notify(%(channel)s, '')
"""
# Every queue with tasks or a pause row: its state and counts (`outboxkit tasks queues`).
QUEUE_STATES = """
WITH counts AS (
    SELECT queue,
           count(*) FILTER (WHERE status <> {running} AND available_at <= now()) AS queued,
           count(*) FILTER (WHERE status = {running}) AS running
    FROM {table}
    WHERE status IN ({pending}, {running})
       OR (status = {waiting} AND key IS NULL AND after_failure IS NULL)  -- (parked)
    GROUP BY queue
)
SELECT coalesce(c.queue, q.queue) AS queue, coalesce(q.paused, false) AS paused,
       q.changed_at, q.changed_by, coalesce(c.queued, 0) AS queued,
       coalesce(c.running, 0) AS running
FROM counts AS c FULL JOIN {queues} AS q ON q.queue = c.queue
ORDER BY 1
"""
PAUSED_QUEUES = "SELECT queue FROM {queues} WHERE paused AND queue = ANY(%s) ORDER BY queue"

# A parked worker's poll (a fleet's idle database, backends/postgres/_pg_session.py), on its
# LISTEN session instead of the claims: seconds until the first task its claims could take
# is due (NULL: none), in its queues that are not paused, of the names it has handlers for
# (NULL: any). A running task counts at its lease's expiry (a dead worker's is claimable
# then); waiting tasks do not (a settle, a release or the sweep makes them pending, and
# notifies). One index probe per queue: the claim index's leading column.
DUE_IN = """
SELECT extract(epoch FROM min(d.at) - now())::float8
FROM unnest(%(queues)s::text[]) AS q(queue)
CROSS JOIN LATERAL (
    SELECT min(t.available_at) AS at FROM {table} AS t
    WHERE t.queue = q.queue AND t.status IN ({pending}, {running})
      AND (%(names)s::text[] IS NULL OR t.task_name = ANY(%(names)s::text[]))
) AS d
WHERE NOT EXISTS (SELECT 1 FROM {queues} AS p WHERE p.queue = q.queue AND p.paused)
"""

# --- periodic tasks ------------------------------------------------------------------

# One run per (schedule, slot): the slot's row and its task are inserted by one statement,
# the task only if the slot's insert won. However many workers try, and however stale their
# view, exactly one inserts it (Oban #1488's double runs came from believed leadership).
ENQUEUE_PERIODIC = """
WITH slot AS (
    INSERT INTO {schedules} (schedule, slot) VALUES (%(schedule)s, %(slot)s)
    ON CONFLICT DO NOTHING
    RETURNING 1
)
INSERT INTO {table} (task_name, queue, payload, priority)
SELECT %(name)s, %(queue)s, %(payload)s::jsonb, %(priority)s FROM slot
RETURNING id
"""
SET_SLOT_TASK = "UPDATE {schedules} SET task_id = %s WHERE schedule = %s AND slot = %s"
LAST_SLOT = "SELECT max(slot), now() FROM {schedules} WHERE schedule = %s"
DATABASE_NOW = "SELECT now()"
# A schedule's slots older than `keep` seconds go, a batch at a time, except its newest
# (where a worker's view of it starts): a per-second cron left 86 400 rows a day. A worker
# whose view of a schedule is older than `keep` (frozen that long) could insert a pruned
# slot again; `keep` is a day.
PRUNE_SLOTS = """
DELETE FROM {schedules} AS s
WHERE (s.schedule, s.slot) IN (
    SELECT o.schedule, o.slot FROM {schedules} AS o
    WHERE o.slot < now() - make_interval(secs => %(keep)s)
      AND o.slot < (SELECT max(m.slot) FROM {schedules} AS m WHERE m.schedule = o.schedule)
    LIMIT %(limit)s)
"""

# --- ops (`outboxkit tasks ...`) ---------------------------------------------------


# The worker's metrics, per task name: queued (pending and due), scheduled (pending, not
# yet due), running, failed, and the age of the oldest due pending task. The table holds
# live and failed tasks only (finished ones are deleted by default): a scan is small. The
# task names are whatever was enqueued (a typo or a generated name makes a new one), so
# only the `max_names` with the most tasks get rows of their own; the rest are summed as
# one: the number of series stays bounded, as the outbox's topics are (ops/metrics.py).
TASK_GAUGES = """
WITH per_name AS (
    SELECT task_name,
           count(*) FILTER (WHERE status <> {running} AND status <> {failed}
                              AND available_at <= now()) AS queued,
           count(*) FILTER (WHERE status <> {running} AND status <> {failed}
                              AND available_at > now()) AS scheduled,
           count(*) FILTER (WHERE status = {running}) AS running,
           count(*) FILTER (WHERE status = {failed}) AS failed,
           min(available_at) FILTER (WHERE status <> {running} AND status <> {failed}
                                       AND available_at <= now()) AS oldest_due,
           count(*) AS tasks
    FROM {table}
    WHERE status IN ({pending}, {running}, {failed})
       OR (status = {waiting} AND key IS NULL AND after_failure IS NULL)  -- (parked)
    GROUP BY task_name
), ranked AS (
    SELECT *, row_number() OVER (ORDER BY tasks DESC, task_name) AS rank FROM per_name
)
SELECT CASE WHEN rank <= %(max_names)s THEN task_name ELSE %(other)s END,
       sum(queued)::bigint, sum(scheduled)::bigint, sum(running)::bigint, sum(failed)::bigint,
       extract(epoch FROM now() - min(oldest_due))::float8
FROM ranked
GROUP BY 1
"""

# `due`: a pending task is queued (due now) or scheduled (due later); a running one's
# available_at is its lease expiry and claimed_by its lease holder.
_LISTED = """
SELECT id, task_name, queue, status, attempts, priority, key, available_at, created_at,
       error_type, last_error, claimed_by, available_at <= now() AS due
FROM {table}
"""
LIST_TASKS = (
    _LISTED
    + """WHERE (%(status)s::int IS NULL OR status = %(status)s)
  AND (%(name)s::text IS NULL OR task_name = %(name)s)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(due)s::bool IS NULL OR (available_at <= now()) = %(due)s)
ORDER BY id LIMIT %(limit)s
"""
)
SHOW_TASK = """
SELECT t.*, t.payload::text AS payload_json,
       ARRAY(SELECT after_id FROM {deps} WHERE task_id = t.id ORDER BY 1) AS upstream,
       ARRAY(SELECT task_id FROM {deps} WHERE after_id = t.id ORDER BY 1 LIMIT 1000)
           AS downstream
FROM {table} AS t WHERE t.id = %s
"""
# A failed or cancelled task runs again from its first attempt (its history is cleared).
# A failed task whose unique_key a live task holds now (or a newer failed one of the same
# key, replayed with it) is left failed and reported: replaying it would break the partial
# unique index, and one collision made the whole replay fail.
REPLAY_TASKS = """
WITH candidates AS MATERIALIZED (
    SELECT id, unique_key FROM {table}
    WHERE status IN ({failed}, {cancelled}) AND (%(all)s OR id = ANY(%(ids)s))
      AND (%(name)s::text IS NULL OR task_name = %(name)s)
), chosen AS (
    SELECT c.id FROM candidates AS c
    WHERE c.unique_key IS NULL
       OR (NOT EXISTS (SELECT 1 FROM {table} AS l
                       WHERE l.unique_key = c.unique_key AND l.status IN ({pending}, {running}))
           AND c.id = (SELECT max(d.id) FROM candidates AS d WHERE d.unique_key = c.unique_key))
), replayed AS (
    UPDATE {table} AS t
    SET status = {pending}, attempts = 0, lapses = 0, spared = 0, available_at = now(),
        claim_token = NULL,
        claimed_by = NULL, last_error = NULL, error_type = NULL, traceback_excerpt = NULL,
        started_at = NULL, finished_at = NULL
    FROM chosen WHERE t.id = chosen.id
    RETURNING t.id
)
SELECT id, NULL::text FROM replayed
UNION ALL
SELECT c.id, c.unique_key FROM candidates AS c WHERE c.id NOT IN (SELECT id FROM chosen)
"""
# Cancelling a running task clears its claim token: the worker's completion (and its
# ctx.transaction(), which raises LeaseLost) then changes nothing.
# Whoever waits on a cancelled task (Tasks.wait) is woken.
CANCEL_TASKS = """
WITH cancelled AS (
    UPDATE {table}
    SET status = {cancelled}, finished_at = now(), claim_token = NULL
    WHERE id = ANY(%s) AND status IN ({pending}, {running}, {waiting})
    RETURNING id
)
SELECT id, pg_notify({results_channel}, id::text) FROM cancelled
"""
# Retention "keep": finished (done and cancelled) tasks older than the cutoff leave in small
# batches, each its own short transaction (no long lock, no vacuum debt in one go).
PURGE_FINISHED = """
DELETE FROM {table} WHERE id = ANY(ARRAY(
    SELECT id FROM {table}
    WHERE status IN ({done}, {cancelled})
      AND finished_at < now() - make_interval(secs => %(age)s)
    LIMIT %(limit)s))
"""
DISCARD_TASKS = """
DELETE FROM {table} WHERE id = ANY(%s) AND status IN ({failed}, {cancelled}) RETURNING id
"""


def unlimited_claim(claim: str, *, skip: bool = True) -> str:
    """CLAIM for the claims of no limited name: the bucket, the limited LIMIT and the spend
    left out, and without ``skip`` the filter of limited names too (the worker passes the
    names it claims instead). Planned once per connection (generic plans), those made
    PostgreSQL give up the index walk: 26 ms a claim of 16 against 0.3 ms."""
    cuts = (
        (
            "WITH bucket AS MATERIALIZED (",
            "), seen AS MATERIALIZED (",
            "WITH seen AS MATERIALIZED (",
        ),
        (
            "    LIMIT greatest(0, least(",
            "    FOR UPDATE OF t SKIP LOCKED",
            "    LIMIT %(limit)s\n",
        ),
        ("), spent AS (", ")\nSELECT * FROM claimed", ""),
    )
    for start, end, keep in cuts:
        i = claim.index(start)
        j = claim.index(end, i)
        claim = claim[:i] + keep + claim[j + (len(end) if end.startswith("), seen") else 0) :]
    claim = claim.replace(
        "      AND (%(name)s::text IS NULL OR t.task_name = %(name)s::text)\n", ""
    )
    for limited, plain in _CLAIM_PARTS.values():  # every key serial, no key's bucket
        claim = claim.replace(limited, plain)
    if not skip:
        claim = claim.replace("      AND NOT t.task_name = ANY(%(skip)s::text[])\n", "")
    return claim


def positional(statement: str) -> tuple[str, tuple[str, ...]]:
    """A statement with ``%(name)s`` parameters as ``%s`` ones, and the names in their order
    (the driver adapters take a sequence; a name may repeat)."""
    names: list[str] = []

    def one(match: re.Match[str]) -> str:
        names.append(match.group(1))
        return "%s"

    return re.sub(r"%\((\w+)\)s", one, statement), tuple(names)


def done_arrays(claims: Iterable[tuple[Sequence[int], uuid.UUID]]) -> tuple[str, str]:
    """The ids and, for each, its claim's token, as the array literals SETTLE_DONE_MANY takes."""
    ids: list[str] = []
    tokens: list[str] = []
    for claim_ids, token in claims:
        ids.extend(map(str, claim_ids))
        tokens.extend([str(token)] * len(claim_ids))
    return "{" + ",".join(ids) + "}", "{" + ",".join(tokens) + "}"


class TaskStatements:
    """Every statement above, rendered for one task table."""

    def __init__(self, table: str = DEFAULT_TASKS_TABLE) -> None:
        schema, name = parse_table(table)
        self.table = table
        self.qualified = quote_table(schema, name)
        self.schedules = quote_table(schema, SCHEDULES_TABLE)
        self.queues_table = quote_table(schema, queues_table_name(name))
        self.deps_table = quote_table(schema, deps_table_name(name))
        self.channel = channel_for(f"tasks.{table}")
        #: Finished tasks that keep results notify their ids here (Tasks.wait listens).
        self.results_channel = channel_for(f"results.{table}")
        slots = {
            "table": self.qualified,
            "schedules": self.schedules,
            "queues": self.queues_table,
            "deps": self.deps_table,
            "limits": quote_table(schema, limits_table_name(name)),
            "key_rates": quote_table(schema, key_rates_table_name(name)),
            "fair": quote_table(schema, fair_table_name(name)),
            "table_literal": f"'{self.qualified}'",
            "no_flush_wait": _NO_FLUSH_WAIT,  # a validated name: no quote inside
            "wake_key": str(wake_lock_key(self.channel)),
            "suspect": str(SUSPECT_LAPSES),
            "results_channel": "'" + self.results_channel.replace("'", "''") + "'",
            **{state: str(int(value)) for state, value in _STATES.items()},
        }
        self.enqueue = ENQUEUE.format(**slots)
        self.enqueue_dollar = numbered(self.enqueue)
        self.enqueue_with_commit = numbered(ENQUEUE_WITH_COMMIT.format(**slots))
        #: A limited name's claim (CLAIM), and every other one (CLAIM without the limits:
        #: its LIMIT a plain parameter, so the generic plan walks the claim index and stops).
        self.claim_limited = CLAIM.format(**slots)
        self.custom_plans = "SET LOCAL plan_cache_mode = force_custom_plan"
        self.claim_skipping = unlimited_claim(CLAIM).format(**slots)
        self.claim = unlimited_claim(CLAIM, skip=False).format(**slots)
        self.claim_limit_lock = CLAIM_LIMIT_LOCK.format(**slots)
        self.claim_bucket = CLAIM_BUCKET.format(**slots)
        self.fail_unhandled = FAIL_UNHANDLED.format(**slots)
        self.settle_done_delete = SETTLE_DONE_DELETE.format(**slots)
        self.settle_done_keep = SETTLE_DONE_KEEP.format(**slots)
        self.settle_failures = SETTLE_FAILURES.format(**slots)
        self.settle_done_many_delete = SETTLE_DONE_MANY_DELETE.format(**slots)
        self.settle_done_many_keep = SETTLE_DONE_MANY_KEEP.format(**slots)
        self.complete_delete = COMPLETE_DELETE.format(**slots)
        self.complete_keep = COMPLETE_KEEP.format(**slots)
        self.complete_kept = COMPLETE_KEPT.format(**slots)
        self.settle_done_results = SETTLE_DONE_RESULTS.format(**slots)
        self.set_result = SET_RESULT.format(**slots)
        self.notify_results = NOTIFY_RESULTS
        self.set_progress = SET_PROGRESS.format(**slots)
        self.read_result = READ_RESULT.format(**slots)
        self.purge_kept = PURGE_KEPT.format(**slots)
        self.prune_key_rates = PRUNE_KEY_RATES.format(**slots)
        self.enqueue_after, self.enqueue_after_names = positional(ENQUEUE_AFTER.format(**slots))
        self.enqueue_after_dollar = numbered(self.enqueue_after)
        self.release_dependents = RELEASE_DEPENDENTS.format(**slots)
        self.read_dependencies = READ_DEPENDENCIES.format(**slots)
        self.prune_edges = PRUNE_EDGES.format(**slots)
        self.promote_keys = PROMOTE_KEYS.format(**slots)
        self.sweep_keys = SWEEP_KEYS.format(**slots)
        self.park_name = PARK_NAME.format(**slots)
        self.promote_name = PROMOTE_NAME.format(**slots)
        self.unpark_names = UNPARK_NAMES.format(**slots)
        self.release = RELEASE.format(**slots)
        self.extend = EXTEND.format(**slots)
        self.hasten = HASTEN.format(**slots)
        self.count_pending = COUNT_PENDING.format(**slots)
        self.autovacuum_off = AUTOVACUUM_OFF.format(**slots)
        self.task_state = TASK_STATE.format(**slots)
        self.check_columns = CHECK_COLUMNS.format(**slots)
        self.tell_fair = TELL_FAIR.format(**slots)
        self.pause_queue = PAUSE_QUEUE.format(**slots)
        self.resume_queue = RESUME_QUEUE.format(**slots)
        self.queue_states = QUEUE_STATES.format(**slots)
        self.paused_queues = PAUSED_QUEUES.format(**slots)
        self.due_in = DUE_IN.format(**slots)
        self.enqueue_periodic = ENQUEUE_PERIODIC.format(**slots)
        self.set_slot_task = SET_SLOT_TASK.format(**slots)
        self.last_slot = LAST_SLOT.format(**slots)
        self.database_now = DATABASE_NOW
        self.prune_slots = PRUNE_SLOTS.format(**slots)
        self.task_gauges = TASK_GAUGES.format(**slots)
        self.list_tasks = LIST_TASKS.format(**slots)
        self.show_task = SHOW_TASK.format(**slots)
        self.replay_tasks = REPLAY_TASKS.format(**slots)
        self.cancel_tasks = CANCEL_TASKS.format(**slots)
        self.discard_tasks = DISCARD_TASKS.format(**slots)
        self.purge_finished = PURGE_FINISHED.format(**slots)
        self.try_wake_lock = TRY_WAKE_LOCK.format(**slots)
        self.wake_unlock = WAKE_UNLOCK.format(**slots)

    def ddl(self) -> str:
        """The whole schema as one script, for users who run their own migration tool."""
        from outboxkit.backends.postgres.migrations import migration_files

        slots = tasks_slots(self.table)
        return "".join(f.render(slots) for f in migration_files("tasks"))


def tasks_migration_lock_key(table: str) -> int:
    """A stable advisory-lock key per task table (never an outbox's)."""
    return zlib.crc32(f"outboxkit.migrate:tasks:{table}".encode())
