"""The `outboxkit tasks …` commands and the worker's task gauges on MariaDB/MySQL: the task
table read and acted on as PostgreSQL's functions (backends/postgres/tasks_pg.py) do, with
the same rows (dicts of the same keys, aware times, ints and bools), so one CLI prints both.

Each takes a URL (a connection of its own, closed after) or an open autocommit PyMySQL
connection (left open). MariaDB has no ``UPDATE … RETURNING``: a replay or a cancel locks
its rows, then updates them, in one short transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outboxkit.backends.mariadb.sql import with_ids
from outboxkit.backends.mariadb.task_admin import _tasks
from outboxkit.backends.mariadb.tasks import utc
from outboxkit.backends.mariadb.tasks_sql import TaskStatements
from outboxkit.queue.tasks import DEFAULT_MAX_TASK_NAMES, OTHER_TASKS, TaskStatus

_TIMES = ("available_at", "created_at", "started_at", "finished_at", "keep_until", "changed_at")
_FLAGS = ("due", "paused", "has_dependents")
_COUNTS = ("queued", "running")
#: A duplicate key (a live task took the unique_key meanwhile): the replay tries again.
_DUPLICATE = 1062


def _rows(cur: Any) -> list[dict[str, Any]]:
    """The cursor's rows as PostgreSQL's dict rows (aware times, bools, ints); JSON columns
    (payload, result, progress) stay text, as PostgreSQL's ``show_task`` gives them: a value
    that does not load still shows."""
    names = [d[0] for d in cur.description]
    rows = []
    for found in cur.fetchall():
        row = dict(zip(names, found, strict=True))
        for column in _TIMES:
            if column in row:
                row[column] = utc(row[column])
        for column in _FLAGS:
            if row.get(column) is not None:
                row[column] = bool(row[column])
        for column in _COUNTS:
            if column in row:
                row[column] = int(row[column])
        rows.append(row)
    return rows


def _ids(statement: str, ids: Sequence[int]) -> str:
    return with_ids(statement, len(ids)) if ids else statement.replace("{ids}", "IN (NULL)")


def list_tasks(
    dsn: Any,
    table: str,
    *,
    status: TaskStatus | None = None,
    name: str | None = None,
    queue: str | None = None,
    due: bool | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Tasks by id (oldest first), optionally of one state, task name, queue and due-ness."""
    state = None if status is None else int(status)
    params = (state, state, name, name, queue, queue, due, due, limit)
    with _tasks(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(TaskStatements(table).list_tasks, params)
        return _rows(cur)


def show_task(dsn: Any, table: str, task_id: int) -> dict[str, Any] | None:
    """Every column of one task (its payload as JSON text) and its edges, or None."""
    sq = TaskStatements(table)
    with _tasks(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(sq.show_task, (task_id,))
        rows = _rows(cur)
        if not rows:
            return None
        row = rows[0]
        for column, statement in (("upstream", sq.upstream), ("downstream", sq.downstream)):
            cur.execute(statement, (task_id,))
            row[column] = [int(i) for (i,) in cur.fetchall()]
        return row


def replay_tasks_reporting(
    dsn: Any, table: str, ids: Sequence[int] = (), *, all_failed: bool = False,
    name: str | None = None,
) -> tuple[list[int], list[tuple[int, str]]]:  # fmt: skip
    """Failed or cancelled tasks back to pending, attempts from zero; the ids replayed, and
    those left failed with their unique_key (a live task holds it, or a newer failed task
    of that key was replayed instead)."""
    import pymysql

    sq = TaskStatements(table)
    with _tasks(dsn, table) as conn, conn.cursor() as cur:
        for attempt in range(3):
            cur.execute("BEGIN")
            try:
                cur.execute(_ids(sq.replay_candidates, ids), (all_failed, *ids, name, name))
                candidates = [(int(i), key) for i, key in cur.fetchall()]
                newest = {key: i for i, key in candidates if key is not None}
                chosen, skipped = [], []
                for task_id, key in candidates:
                    if key is not None and (newest[key] != task_id or cur.execute(
                        sq.unique_live, (key,)
                    )):  # fmt: skip
                        skipped.append((task_id, str(key)))
                    else:
                        chosen.append(task_id)
                if chosen:
                    cur.execute(with_ids(sq.replay, len(chosen)), chosen)
                cur.execute("COMMIT")
                return chosen, skipped
            except pymysql.err.IntegrityError as exc:  # a task enqueued with that key
                cur.execute("ROLLBACK")
                if attempt == 2 or exc.args[0] != _DUPLICATE:
                    raise
            except BaseException:
                cur.execute("ROLLBACK")
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def cancel_tasks(dsn: Any, table: str, ids: Sequence[int]) -> list[int]:
    """Pending, waiting or running tasks cancelled (a running one's completion becomes a
    no-op); the ids cancelled."""
    if not ids:
        return []
    sq = TaskStatements(table)
    with _tasks(dsn, table) as conn, conn.cursor() as cur:
        cur.execute("BEGIN")
        try:
            cur.execute(with_ids(sq.cancel_lock, len(ids)), list(ids))
            done = [int(i) for (i,) in cur.fetchall()]
            if done:
                cur.execute(with_ids(sq.cancel, len(done)), done)
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        return done


def discard_tasks(dsn: Any, table: str, ids: Sequence[int]) -> list[int]:
    """Failed or cancelled tasks deleted for good; the ids deleted."""
    if not ids:
        return []
    with _tasks(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(with_ids(TaskStatements(table).discard, len(ids)), list(ids))
        return sorted(int(i) for (i,) in cur.fetchall())


def queue_states(dsn: Any, table: str) -> list[dict[str, Any]]:
    """Every queue with live tasks or a pause record: paused, since when and by whom, and
    its queued and running counts."""
    with _tasks(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(TaskStatements(table).queue_states)
        return _rows(cur)


def purge_finished(dsn: str, table: str, *, older_than: float, batch_size: int = 1000) -> int:
    """Delete done and cancelled tasks finished over ``older_than`` seconds ago, in batches."""
    statement = TaskStatements(table).purge_finished
    total = 0
    with _tasks(dsn, table) as conn, conn.cursor() as cur:
        while True:
            deleted = int(cur.execute(statement, (int(older_than * 1e6), batch_size)))
            total += deleted
            if deleted < batch_size:
                return total


def task_gauges(
    dsn: Any, table: str, *, max_names: int = DEFAULT_MAX_TASK_NAMES
) -> list[tuple[Any, ...]]:
    """Per task name: queued, scheduled, running, failed, oldest queued age (s) or None;
    the ``max_names`` names with the most tasks a row each, the rest summed as ``(other)``."""
    if max_names < 0:
        raise ValueError("the number of task names with gauges cannot be negative")
    with _tasks(dsn, table) as conn, conn.cursor() as cur:
        cur.execute(TaskStatements(table).task_gauges, (max_names, OTHER_TASKS))
        return [
            (name, *(int(n) for n in counts), None if age is None else float(age))
            for name, *counts, age in cur.fetchall()
        ]
