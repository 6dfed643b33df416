"""Every statement of task mode on MariaDB/MySQL, by name; table names through :func:`quote`.

PostgreSQL's (backends/postgres/tasks_sql.py) under the same names, with MariaDB's means:
no ``UPDATE … RETURNING`` and no CTEs that write, so a claim or a settle is a few statements
in one short transaction (lock with ``FOR UPDATE SKIP LOCKED``, update those ids, read them
back); no partial indexes, so the claim index and the unique index are on stored generated
columns that are NULL for finished tasks (0001_tasks.sql); no arrays, so id lists are
expanded into ``IN (%s, …)`` (``{ids}``); no advisory locks held to COMMIT, so a keyed
enqueue locks a row of ``<table>_key_locks`` and a limited name's claims lock its row of
``<table>_limits``. Times are ``UTC_TIMESTAMP(6)`` on UTC ``DATETIME(6)`` columns.
"""

from __future__ import annotations

import functools

from outboxkit.backends.mariadb.sql import HEX_DIGIT, NOW, ids_in, quote, sibling
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE, SUSPECT_LAPSES, TaskStatus

#: Periodic tasks' slots, beside the task table (PostgreSQL's name).
SCHEDULES_TABLE = "outboxkit_schedules"
PENDING, RUNNING, DONE = int(TaskStatus.PENDING), int(TaskStatus.RUNNING), int(TaskStatus.DONE)
FAILED, CANCELLED = int(TaskStatus.FAILED), int(TaskStatus.CANCELLED)
WAITING = int(TaskStatus.WAITING)
_LIVE = f"({PENDING}, {RUNNING})"
#: The crash-loop guard's error (PostgreSQL's words).
CRASH_LOOP = (
    "CONCAT('worker: claimed ', attempts, ' times without finishing (each worker died or hung"
    " running it): dead-lettered unread; see `outboxkit tasks failed`, then replay or discard"
    " it')"
)
#: A key's lock row (one of 65 536): the key's CRC32, as ordered mode's writes.
KEY_SLOT = "CRC32(%s) & 65535"


def _index(table: str, suffix: str) -> str:
    return quote(f"{table.split('.')[-1]}_{suffix}"[:64])


def digests_in(count: int) -> str:
    """``IN (…)`` of ``count`` keys' digests (the key buckets' primary key)."""
    return "IN (" + ", ".join(["UNHEX(SHA2(%s, 256))"] * count) + ")"


def tasks_slots(table: str) -> dict[str, str]:
    """The placeholders of the task table's migration files (migrations/tasks/)."""
    *database, _bare = table.split(".")
    schedules = ".".join([*database, SCHEDULES_TABLE])
    return {
        "table": quote(table),
        "schedules": quote(schedules),
        "queues": quote(sibling(table, "queues")),
        "deps": quote(sibling(table, "deps")),
        "limits": quote(sibling(table, "limits")),
        "key_locks": quote(sibling(table, "key_locks")),
        "key_rates": quote(sibling(table, "key_rates")),
        "index_pending": _index(table, "claim"),
        "index_unique": _index(table, "unique"),
        "index_key": _index(table, "key"),
        "index_running": _index(table, "running"),
        "index_status": _index(table, "status"),
        "index_kept": _index(table, "kept"),
        "index_deps_after": _index(sibling(table, "deps"), "after"),
        "pending": str(PENDING),
        "running": str(RUNNING),
        "failed": str(FAILED),
        "waiting": str(WAITING),
        "hex_digit": HEX_DIGIT,
    }


#: The columns an enqueue fills, in its parameters' order (the registry's ``_params``
#: order: available_at takes two, a run-at time or a delay added to the database's clock).
ENQUEUE_COLUMNS = (
    "task_name", "queue", "payload", "priority", "`key`", "unique_key", "max_attempts",
    "available_at", "trace",
)  # fmt: skip
_CLAIMED = (
    "id, task_name, queue, payload, attempts, max_attempts, `key`, priority, created_at,"
    " spared, has_dependents, trace, last_error"
)
_RESULT = (
    f"task_name, status, available_at > {NOW} AS later, result, last_error, error_type,"
    " traceback_excerpt, attempts, progress, created_at, started_at, finished_at"
)
_RESULT_OF_U = "u." + _RESULT.replace(", ", ", u.")


class TaskStatements:
    """Task mode's statements on one task table (names as PostgreSQL's TaskStatements)."""

    def __init__(self, table: str = DEFAULT_TASKS_TABLE) -> None:
        self.table = table
        s = tasks_slots(table)
        t, self.qualified = s["table"], s["table"]
        deps, limits, queues = s["deps"], s["limits"], s["queues"]
        self.schedules = s["schedules"]
        by_id = f"{t} FORCE INDEX (PRIMARY)"
        self._by_id = by_id
        self._claim_index = s["index_pending"]
        # -- enqueue (the caller's transaction) ------------------------------------------
        # A keyed task first locks its key's row of key_locks (to COMMIT): the derived table
        # is materialised before the row takes its AUTO_INCREMENT id, so one key's ids follow
        # its commit order. Behind a live task of its key (or one waiting its turn) it waits
        # (status waiting, after_failure NULL), out of the claim index, until its key's head
        # ends (PROMOTE). A duplicate live unique_key inserts nothing (IGNORE: the unique
        # index on live_unique waits for the transaction holding it, then skips or inserts).
        # (Read under REPEATABLE READ, the key's live rows get shared locks to the caller's
        # COMMIT: its head's settle waits for that COMMIT.)
        values = ", ".join(
            f"COALESCE(%s, {NOW} + INTERVAL %s MICROSECOND) AS available_at"
            if c == "available_at"
            else f"%s AS {c}"
            for c in ENQUEUE_COLUMNS
        )
        columns = ", ".join(ENQUEUE_COLUMNS)
        status = (
            f"CASE WHEN v.`key` IS NOT NULL AND v.unique_key IS NULL AND EXISTS ("
            f"SELECT 1 FROM {t} AS h FORCE INDEX ({s['index_key']}) WHERE h.`key` = v.`key`"
            f" AND (h.status IN {_LIVE} OR (h.status = {WAITING} AND h.after_failure IS NULL)))"
            f" THEN {WAITING} ELSE {PENDING} END"
        )
        self.enqueue = (
            f"INSERT IGNORE INTO {t} ({columns}, status)"
            f" SELECT v.*, {status}"
            f" FROM (SELECT COUNT(*) AS n FROM {s['key_locks']} FORCE INDEX (PRIMARY)"
            f" WHERE slot = {KEY_SLOT} FOR UPDATE) AS l, (SELECT {values}) AS v"
            " RETURNING id"
        )
        # enqueue(after=[...]): the upstream tasks marked (their rows locked to COMMIT, so a
        # worker completing one waits for this transaction) and read, then the task inserted
        # waiting unless every one is done, then its edges.
        self.mark_upstream = f"UPDATE {by_id} SET has_dependents = TRUE WHERE id {{ids}}"
        self.upstream_present = (
            f"SELECT GROUP_CONCAT(id, ':', status) FROM {by_id} WHERE id {{ids}}"
        )
        self.enqueue_after = (
            f"INSERT INTO {t} ({columns}, status, after_failure)"
            f" SELECT v.*, %s, %s FROM (SELECT {values}) AS v RETURNING id"
        )
        self.insert_edges = f"INSERT INTO {deps} (task_id, after_id) VALUES "
        # -- the claim (one short READ COMMITTED transaction) ----------------------------
        self.queue_paused = f"SELECT paused FROM {queues} WHERE queue = %s"
        # `Tasks.pause()` / `resume()`: the row before (locked), then the new state.
        self.queue_paused_locked = self.queue_paused + " FOR UPDATE"
        self.set_queue_paused = (
            f"INSERT INTO {queues} (queue, paused, changed_at, changed_by)"
            f" VALUES (%s, %s, {NOW}, %s) ON DUPLICATE KEY UPDATE paused = %s,"
            f" changed_at = {NOW}, changed_by = %s"
        )
        # A limited name's claims serialize on its row (FOR UPDATE, to COMMIT); under READ
        # COMMITTED each later statement then sees every claim of the name committed before.
        # (ON DUPLICATE KEY UPDATE: an exclusive lock at once; INSERT IGNORE's shared lock
        # on the existing row, then FOR UPDATE, deadlocked two racing claims)
        self.limit_row = (
            f"INSERT INTO {limits} (task_name, tokens, at) VALUES (%s, %s, {NOW})"
            " ON DUPLICATE KEY UPDATE task_name = task_name"
        )
        self.limit_lock = (
            f"SELECT tokens, TIMESTAMPDIFF(MICROSECOND, at, {NOW}) / 1e6 FROM {limits}"
            " WHERE task_name = %s FOR UPDATE"
        )
        self.limit_spend = f"UPDATE {limits} SET tokens = %s, at = {NOW} WHERE task_name = %s"
        self.running_count = (
            f"SELECT COUNT(*) FROM {t} FORCE INDEX ({s['index_running']})"
            f" WHERE task_name = %s AND status = {RUNNING} AND available_at > {NOW}"
        )
        # Of the locked rows, a keyed one is claimable only while no earlier task of its key
        # is live (a plain read, after the lock: PostgreSQL's NOT EXISTS in the claim).
        self.key_heads = (
            f"SELECT `key`, MIN(id) FROM {t} FORCE INDEX ({s['index_key']})"
            f" WHERE `key` {{keys}} AND status IN {_LIVE} GROUP BY `key`"
        )
        # The lease in available_at, a new attempt, a fresh token. Assignments run left to
        # right on MariaDB: spared and lapses read the row's status before it is set.
        ambiguous = f"(status = {RUNNING} AND lapses < {SUSPECT_LAPSES})"
        self.claim_lease = (
            f"UPDATE {by_id} SET spared = spared + {ambiguous}, lapses = lapses + {ambiguous},"
            f" attempts = attempts + 1, status = {RUNNING},"
            f" available_at = {NOW} + INTERVAL %s MICROSECOND, claim_token = %s,"
            f" claimed_by = %s, started_at = {NOW} WHERE id {{ids}}"
        )
        self.claim_dead = (
            f"UPDATE {by_id} SET status = {FAILED}, claim_token = NULL, claimed_by = %s,"
            f" finished_at = {NOW}, error_type = 'CrashLoop', last_error = {CRASH_LOOP}"
            " WHERE id {ids}"
        )
        self.claim_read = f"SELECT {_CLAIMED} FROM {by_id} WHERE id {{ids}}"
        self.fail_unhandled_lock = (
            f"SELECT id, task_name FROM {t} FORCE INDEX ({self._claim_index})"
            f" WHERE live_queue {{queues}} AND status = {PENDING}"
            f" AND available_at < {NOW} - INTERVAL %s MICROSECOND {{names}}"
            " LIMIT %s FOR UPDATE SKIP LOCKED"
        )
        self.fail_unhandled = (
            f"UPDATE {by_id} SET status = {FAILED}, finished_at = {NOW}, claim_token = NULL,"
            " error_type = 'UnknownTask', last_error = CONCAT('no worker with a handler for"
            " task ', task_name, ' claimed it within ', %s, ' s of its due time: deploy a"
            " worker whose --app registers it, then `outboxkit tasks replay`') WHERE id {ids}"
        )
        # -- settles, each fenced by the claim token -------------------------------------
        self.fenced_tokens = f"SELECT id, claim_token FROM {by_id} WHERE id {{ids}} FOR UPDATE"
        self.fenced_ids = f"SELECT id FROM {by_id} WHERE id {{ids}} AND claim_token = %s FOR UPDATE"
        self.settle_done_delete = f"DELETE {t} FROM {by_id} WHERE id {{ids}} AND claim_token = %s"
        self.settle_done_keep = (
            f"UPDATE {by_id} SET status = {DONE}, finished_at = {NOW}, claim_token = NULL"
            " WHERE id {ids} AND claim_token = %s"
        )
        # Grouped completions of several claims: the rows locked (fenced_tokens) and
        # matched to their claims' tokens in this transaction first.
        self.locked_done_delete = f"DELETE {t} FROM {by_id} WHERE id {{ids}}"
        self.locked_done_keep = (
            f"UPDATE {by_id} SET status = {DONE}, finished_at = {NOW}, claim_token = NULL"
            " WHERE id {ids}"
        )
        self.settle_done_result = (
            f"UPDATE {t} SET status = {DONE}, finished_at = {NOW}, claim_token = NULL,"
            f" result = %s, keep_until = {NOW} + INTERVAL %s MICROSECOND,"
            " progress = COALESCE(%s, progress) WHERE id = %s AND claim_token = %s"
        )
        # A retry, dead letter or hand-back (its own delay, error and refund): a hand-back
        # keeps its lapses (it did not run), any outcome clears them.
        self.settle_failure = (
            f"UPDATE {t} SET lapses = IF(%s = 1, lapses, 0), attempts = GREATEST(attempts - %s, 0),"
            f" status = %s, available_at = {NOW} + INTERVAL %s MICROSECOND,"
            " last_error = COALESCE(%s, last_error), error_type = COALESCE(%s, error_type),"
            " traceback_excerpt = COALESCE(%s, traceback_excerpt), claim_token = NULL,"
            f" finished_at = IF(%s = {FAILED}, {NOW}, NULL) WHERE id = %s AND claim_token = %s"
        )
        # The value of a task completed in ctx.transaction(), once its handler returned:
        # fenced by the attempt that completed it (no other attempt runs a done task).
        self.set_result = (
            f"UPDATE {t} SET result = %s WHERE id = %s AND attempts = %s AND status = {DONE}"
            " AND result IS NULL"
        )
        self.set_progress = (
            f"UPDATE {t} SET progress = %s WHERE id = %s AND claim_token = %s"
            f" AND status = {RUNNING}"
        )
        # ctx.transaction(): its last statement, fenced; no row: the lease was lost.
        self.complete_delete = f"DELETE FROM {t} WHERE id = %s AND claim_token = %s"
        self.complete_keep = (
            f"UPDATE {t} SET status = {DONE}, finished_at = {NOW}, claim_token = NULL"
            " WHERE id = %s AND claim_token = %s"
        )
        self.complete_kept = (
            f"UPDATE {t} SET status = {DONE}, finished_at = {NOW}, claim_token = NULL,"
            f" keep_until = {NOW} + INTERVAL %s MICROSECOND, progress = COALESCE(%s, progress)"
            " WHERE id = %s AND claim_token = %s"
        )
        # The heartbeat never revives a lapsed lease (its slot may be another task's now).
        self.extend = (
            f"UPDATE {by_id} SET available_at = {NOW} + INTERVAL %s MICROSECOND"
            f" WHERE id {{ids}} AND claim_token = %s AND status = {RUNNING}"
            f" AND available_at > {NOW}"
        )
        self.release = (
            f"UPDATE {by_id} SET status = {PENDING}, available_at = {NOW}, claim_token = NULL,"
            " attempts = GREATEST(attempts - 1, 0) WHERE id {ids} AND claim_token = %s"
        )
        self.hasten = (
            f"UPDATE {by_id} SET available_at = {NOW} WHERE id {{ids}} AND status = {PENDING}"
            f" AND claim_token IS NULL AND available_at > {NOW}"
        )
        # -- kept results, dependents, keys ----------------------------------------------
        self.purge_kept = (
            f"DELETE FROM {t} WHERE keep_until < {NOW} AND status IN ({DONE}, {CANCELLED}) LIMIT %s"
        )
        self.gone_edges = (
            f"SELECT DISTINCT d.task_id FROM {deps} AS d LEFT JOIN {t} AS t ON t.id = d.task_id"
            " WHERE t.id IS NULL LIMIT %s"
        )
        self.prune_edges = f"DELETE FROM {deps} WHERE task_id {{ids}}"
        waiting = f"{t} FORCE INDEX ({s['index_status']})"
        # Waiting dependents, locked in id order (a concurrent release waits, then reads
        # them anew): of the given upstream tasks, or any (the sweep).
        self.dependents_of = (
            f"SELECT id FROM {waiting} WHERE status = {WAITING} AND after_failure IS NOT NULL"
            f" AND id IN (SELECT task_id FROM {deps} WHERE after_id {{ids}})"
            " ORDER BY id LIMIT %s FOR UPDATE"
        )
        self.any_dependents = (
            f"SELECT id FROM {waiting} WHERE status = {WAITING} AND after_failure IS NOT NULL"
            " ORDER BY id LIMIT %s FOR UPDATE"
        )
        self.dependents_state = (
            f"SELECT d.task_id, t.after_failure,"
            f" COALESCE(SUM(u.status IN ({PENDING}, {RUNNING}, {WAITING})), 0),"
            f" MIN(IF(u.status IN ({FAILED}, {CANCELLED}), d.after_id, NULL))"
            f" FROM {deps} AS d JOIN {t} AS t ON t.id = d.task_id"
            f" LEFT JOIN {t} AS u ON u.id = d.after_id WHERE d.task_id {{ids}}"
            " GROUP BY d.task_id, t.after_failure"
        )
        self.release_pending = (
            f"UPDATE {by_id} SET status = {PENDING} WHERE id {{ids}} AND status = {WAITING}"
        )
        self.release_cancelled = (
            f"UPDATE {t} SET status = {CANCELLED}, finished_at = {NOW},"
            " error_type = 'UpstreamFailed', last_error = CONCAT('upstream task ', %s,"
            " ' failed or was cancelled, so this task was cancelled (after_failure=\"cancel\")')"
            f" WHERE id = %s AND status = {WAITING}"
        )
        # A key's promotion: _key_controls's key_waiting_lock, key_room, promote_ids.
        # (a scan of the waiting tasks' index: a key flooded with waiting tasks is read whole)
        self.waiting_keys = (
            f"SELECT DISTINCT `key` FROM {waiting} WHERE status = {WAITING}"
            " AND after_failure IS NULL AND `key` IS NOT NULL LIMIT %s"
        )
        self.read_dependencies = (
            f"SELECT d.after_id, u.id, {_RESULT_OF_U} FROM {deps} AS d"
            f" LEFT JOIN {t} AS u ON u.id = d.after_id WHERE d.task_id = %s ORDER BY d.after_id"
        )
        self.read_result = f"SELECT id, {_RESULT} FROM {t} WHERE id = %s"
        # -- start-up --------------------------------------------------------------------
        self.count_pending = (
            f"SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE status = {PENDING} LIMIT %s) AS p"
        )
        self.check_columns = (
            "SELECT lapses, spared, result, progress, keep_until, has_dependents, after_failure,"
            f" trace, live_queue, live_unique FROM {t} LIMIT 0"
        )
        self.check_tables = (
            f"SELECT (SELECT 1 FROM {queues} LIMIT 0), (SELECT 1 FROM {deps} LIMIT 0),"
            f" (SELECT 1 FROM {limits} LIMIT 0), (SELECT 1 FROM {s['key_locks']} LIMIT 0),"
            f" (SELECT 1 FROM {s['key_rates']} LIMIT 0)"
        )
        # -- periodic tasks --------------------------------------------------------------
        sched = self.schedules
        self.insert_slot = f"INSERT IGNORE INTO {sched} (schedule, slot) VALUES (%s, %s)"
        self.enqueue_periodic = (
            f"INSERT INTO {t} (task_name, queue, payload, priority) VALUES (%s, %s, %s, %s)"
            " RETURNING id"
        )
        self._key_controls(s)
        self.set_slot_task = f"UPDATE {sched} SET task_id = %s WHERE schedule = %s AND slot = %s"
        self.last_slot = f"SELECT MAX(slot), {NOW} FROM {sched} WHERE schedule = %s"
        self.database_now = f"SELECT {NOW}"
        self.prune_slots = (
            f"DELETE s FROM {sched} AS s JOIN (SELECT o.schedule, o.slot FROM {sched} AS o"
            f" WHERE o.slot < {NOW} - INTERVAL %s MICROSECOND AND o.slot < (SELECT MAX(m.slot)"
            f" FROM {sched} AS m WHERE m.schedule = o.schedule) LIMIT %s) AS x"
            " ON s.schedule = x.schedule AND s.slot = x.slot"
        )

        # -- ops (`outboxkit tasks …`, the worker's task gauges): PostgreSQL's names -------
        # `due`: a pending task is queued (due now) or scheduled (due later); a running
        # one's available_at is its lease expiry. Each filter is `%s IS NULL OR …` (twice).
        self.list_tasks = (
            "SELECT id, task_name, queue, status, attempts, priority, `key`, available_at,"
            " created_at, error_type, last_error, claimed_by, available_at <= "
            f"{NOW} AS due FROM {t} WHERE (%s IS NULL OR status = %s)"
            " AND (%s IS NULL OR task_name = %s) AND (%s IS NULL OR queue = %s)"
            f" AND (%s IS NULL OR (available_at <= {NOW}) = %s) ORDER BY id LIMIT %s"
        )
        # Every column but the generated ones, in PostgreSQL's order; the payload as text.
        self.show_task = (
            "SELECT id, task_name, queue, payload, priority, `key`, unique_key, status,"
            " attempts, max_attempts, available_at, claim_token, claimed_by, last_error,"
            " error_type, traceback_excerpt, created_at, started_at, finished_at, lapses,"
            " spared, result, progress, keep_until, has_dependents, after_failure, trace,"
            f" payload AS payload_json FROM {t} WHERE id = %s"
        )
        self.upstream = f"SELECT after_id FROM {deps} WHERE task_id = %s ORDER BY 1"
        self.downstream = f"SELECT task_id FROM {deps} WHERE after_id = %s ORDER BY 1 LIMIT 1000"
        # Replay (one transaction): the failed or cancelled candidates locked, then those
        # chosen (no unique_key; or none live with it and the newest candidate of it) set
        # back to their first attempt; the rest reported. The live check reads the unique
        # index locking (a concurrent enqueue of that key waits, or is seen).
        self.replay_candidates = (
            f"SELECT id, unique_key FROM {by_id} WHERE status IN ({FAILED}, {CANCELLED})"
            " AND (%s OR id {ids}) AND (%s IS NULL OR task_name = %s) ORDER BY id FOR UPDATE"
        )
        self.unique_live = (
            f"SELECT 1 FROM {t} WHERE live_unique = UNHEX(SHA2(%s, 256)) LOCK IN SHARE MODE"
        )
        self.replay = (
            f"UPDATE {by_id} SET status = {PENDING}, attempts = 0, lapses = 0, spared = 0,"
            f" available_at = {NOW}, claim_token = NULL, claimed_by = NULL, last_error = NULL,"
            " error_type = NULL, traceback_excerpt = NULL, started_at = NULL,"
            " finished_at = NULL WHERE id {ids}"
        )
        # Cancelling a running task clears its claim token: its completion changes nothing.
        cancellable = f"({PENDING}, {RUNNING}, {WAITING})"
        self.cancel_lock = (
            f"SELECT id FROM {by_id} WHERE id {{ids}} AND status IN {cancellable}"
            " ORDER BY id FOR UPDATE"
        )
        self.cancel = (
            f"UPDATE {by_id} SET status = {CANCELLED}, finished_at = {NOW}, claim_token = NULL"
            " WHERE id {ids}"
        )
        self.discard = (
            f"DELETE FROM {t} WHERE id {{ids}} AND status IN ({FAILED}, {CANCELLED}) RETURNING id"
        )
        # Retention "keep": a batch of finished tasks at a time, each its own statement.
        self.purge_finished = (
            f"DELETE FROM {t} WHERE status IN ({DONE}, {CANCELLED})"
            f" AND finished_at < {NOW} - INTERVAL %s MICROSECOND LIMIT %s"
        )
        # Every queue with live tasks or a pause row (no FULL JOIN: the union of names).
        live = f"FROM {t} FORCE INDEX ({s['index_status']}) WHERE status IN {_LIVE}"
        self.queue_states = (
            "SELECT n.queue, COALESCE(p.paused, FALSE) AS paused, p.changed_at, p.changed_by,"
            " COALESCE(c.queued, 0) AS queued, COALESCE(c.running, 0) AS running"
            f" FROM (SELECT DISTINCT queue {live} UNION SELECT queue FROM {queues}) AS n"
            f" LEFT JOIN (SELECT queue, SUM(status = {PENDING} AND available_at <= {NOW})"
            f" AS queued, SUM(status = {RUNNING}) AS running {live} GROUP BY queue) AS c"
            f" ON c.queue = n.queue LEFT JOIN {queues} AS p ON p.queue = n.queue ORDER BY 1"
        )
        # The worker's gauges per task name (PostgreSQL's TASK_GAUGES): the `max_names`
        # names with the most tasks get a row each, the rest one row named `other`.
        due, pending_due = f"available_at <= {NOW}", f"status = {PENDING} AND available_at"
        self.task_gauges = (
            "WITH per_name AS (SELECT task_name,"
            f" SUM({pending_due} <= {NOW}) AS queued, SUM({pending_due} > {NOW}) AS scheduled,"
            f" SUM(status = {RUNNING}) AS running, SUM(status = {FAILED}) AS failed,"
            f" MIN(IF(status = {PENDING} AND {due}, available_at, NULL)) AS oldest_due,"
            f" COUNT(*) AS tasks FROM {t} FORCE INDEX ({s['index_status']})"
            f" WHERE status IN ({PENDING}, {RUNNING}, {FAILED}) GROUP BY task_name),"
            " ranked AS (SELECT *, ROW_NUMBER() OVER (ORDER BY tasks DESC, task_name) AS"
            " `rank` FROM per_name)"
            " SELECT IF(`rank` <= %s, task_name, %s) AS name, SUM(queued), SUM(scheduled),"
            " SUM(running), SUM(failed),"
            f" TIMESTAMPDIFF(MICROSECOND, MIN(oldest_due), {NOW}) / 1e6 FROM ranked GROUP BY 1"
        )

    def _key_controls(self, s: dict[str, str]) -> None:
        """The per-key controls' statements (``concurrency_per_key=N``, ``rate_per_key=``,
        ``fair=True``): PostgreSQL's _KEY_TURN, key buckets and PROMOTE_KEYS, in steps."""
        t, by_id, rates = s["table"], self._by_id, s["key_rates"]
        keyed = f"{t} FORCE INDEX ({s['index_key']})"
        # A keyed task of a name with N > 1 is claimable while it is among its key's first N
        # live tasks (fewer than N earlier ones live): read after the claim's lock, so a task
        # another claim holds counts. No lock is needed: a claim turns pending into running,
        # both live; only a settle takes a task out and a promotion adds later ids.
        self.key_turns = (
            f"SELECT id FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY `key` ORDER BY id)"
            f" AS turn FROM {keyed} WHERE `key` {{keys}} AND status IN {_LIVE}) AS x"
            " WHERE turn <= %s"
        )
        # A key's bucket (rate_per_key): refilled by the database's clock at the claim's
        # rate up to its burst; a key without a row has a full one. The row is found by the
        # key's digest (the primary key: a key is longer than an index key may be).
        refilled = (
            "LEAST(%s, b.tokens + TIMESTAMPDIFF(MICROSECOND, b.at, {now}) / 1e6 * %s)"
        ).replace("{now}", NOW)
        self._key_has_token = (
            f"(`key` IS NULL OR COALESCE((SELECT {refilled} FROM {rates} AS b"
            f" WHERE b.task_name = %s AND b.key_digest = UNHEX(SHA2({t}.`key`, 256))), %s) >= 1)"
        )
        self.key_buckets = (
            f"SELECT b.`key`, {refilled} FROM {rates} AS b WHERE b.task_name = %s"
            " AND b.key_digest {digests}"
        )
        # The spend (under the name's row lock, as the name's own bucket): each key's tokens
        # less the tasks this claim started of it, as of now, with the claim's rate and burst
        # (the prune reads them).
        self.key_spend = (
            f"INSERT INTO {rates} (task_name, key_digest, `key`, tokens, at, rate, burst)"
            f" VALUES (%s, UNHEX(SHA2(%s, 256)), %s, %s, {NOW}, %s, %s)"
            " ON DUPLICATE KEY UPDATE tokens = VALUES(tokens), at = VALUES(at),"
            " rate = VALUES(rate), burst = VALUES(burst)"
        )
        # Refilled buckets are the same as none: the maintenance deletes a batch of them.
        self.prune_key_rates = (
            f"DELETE FROM {rates} WHERE tokens + TIMESTAMPDIFF(MICROSECOND, at, {NOW}) / 1e6"
            " * rate >= burst LIMIT %s"
        )
        # A key's promotion, one transaction: its first waiting tasks locked in id order (a
        # concurrent promotion of the key waits here, then reads them anew: none promoted
        # twice), then its live and pending tasks counted (after the lock, so that promotion's
        # commit is seen: neither adds more than the room it saw), then the chosen ones made
        # pending. A fair name's go behind every task already due (available_at moved to now)
        # unless it is its key's only pending one.
        self.key_waiting_lock = (
            f"SELECT id, task_name FROM {keyed} WHERE `key` = %s AND status = {WAITING}"
            " AND after_failure IS NULL ORDER BY id LIMIT %s FOR UPDATE"
        )
        self.key_room = (
            f"SELECT (SELECT COUNT(*) FROM (SELECT 1 FROM {keyed} WHERE `key` = %s"
            f" AND status IN {_LIVE} LIMIT %s) AS l), (SELECT COUNT(*) FROM (SELECT 1"
            f" FROM {keyed} WHERE `key` = %s AND status = {PENDING} LIMIT %s) AS p)"
        )
        self.promote_ids = (
            f"UPDATE {by_id} SET status = {PENDING} WHERE id {{ids}} AND status = {WAITING}"
        )
        self.promote_behind = (
            f"UPDATE {by_id} SET status = {PENDING}, available_at = GREATEST(available_at, {NOW})"
            f" WHERE id {{ids}} AND status = {WAITING}"
        )

    @functools.lru_cache(maxsize=64)  # noqa: B019 (few shapes per store, kept with it)
    def claim_lock(
        self, names: int | None, skip: int, name: bool, alone: bool, key_rate: bool = False
    ) -> str:
        """Lock a batch of the queue's claimable tasks, skipping those another claim holds
        (parameters: queue, [names], [name], [skip], [key_burst, key_rate, name, key_burst],
        limit): due pending tasks and running ones whose lease ran out, highest priority
        first, in the claim index's order. ``alone``: suspects only (their next lapse makes
        SUSPECT_LAPSES); ``key_rate``: passing keyed tasks whose key's bucket is empty."""
        where = [f"live_queue = %s AND available_at <= {NOW}"]
        if names is not None:
            where.append(f"task_name {ids_in(names)}" if names else "FALSE")
        if name:
            where.append("task_name = %s")
        if skip:
            where.append(f"task_name NOT {ids_in(skip)}")
        if alone:
            where.append(f"lapses + (status = {RUNNING}) >= {SUSPECT_LAPSES}")
        if key_rate:
            where.append(self._key_has_token)
        return (
            f"SELECT id, status, attempts, spared, lapses, max_attempts, `key`"
            f" FROM {self.qualified} FORCE INDEX ({self._claim_index})"
            f" WHERE {' AND '.join(where)} ORDER BY priority DESC, available_at, id"
            " LIMIT %s FOR UPDATE SKIP LOCKED"
        )
