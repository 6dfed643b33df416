"""Task mode's reads and switches on MariaDB/MySQL, as ``Tasks`` asks them (TaskAdmin):
one task's result, a wait for it, pausing and resuming a queue.

Each takes a URL (a connection of its own, closed after) or an open PyMySQL connection
(left open); ``await_result`` a URL or an aiomysql connection. No LISTEN: a wait looks again
with backoff, from 50 ms doubling up to a second, as PostgreSQL's does behind a pooler.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from outboxkit.backends.mariadb.admin import _connection
from outboxkit.backends.mariadb.tasks import result_row
from outboxkit.backends.mariadb.tasks_sql import TaskStatements
from outboxkit.errors import SchemaError
from outboxkit.queue.tasks import task_finished, task_gone, task_late

#: A wait looks again after this long, doubling up to WAIT_POLL_CAP (no LISTEN here).
WAIT_POLL_FIRST = 0.05
WAIT_POLL_CAP = 1.0


def _tasks(source: Any, table: str) -> Any:
    def missing() -> Exception:
        return SchemaError(
            f"task table {table!r} not found: run `outboxkit migrate --tasks --dsn mysql://..."
            f" --tasks-table {table}`"
        )

    return _connection(source, missing)


def _read(conn: Any, table: str, task_id: int) -> dict[str, Any] | None:
    with conn.cursor() as cur:
        cur.execute(TaskStatements(table).read_result, (task_id,))
        row = cur.fetchone()
        return None if row is None else result_row([d[0] for d in cur.description], row)


def read_result(source: Any, table: str, task_id: int) -> dict[str, Any] | None:
    """One task's state, value, error, progress and timings (``read_result``), or None."""
    with _tasks(source, table) as conn:
        return _read(conn, table, task_id)


def _autocommit(source: Any, what: str) -> None:
    if not isinstance(source, str) and not source.get_autocommit():
        raise TypeError(
            f"Tasks.{what}() needs a DSN or an autocommit connection: it reads the task again"
            " and again, which one open transaction's snapshot would hold back"
        )


def wait_result(source: Any, table: str, task_id: int, timeout: float) -> dict[str, Any]:
    """The task's row once finished, looking again with backoff; TimeoutError naming its
    last state."""
    _autocommit(source, "wait")
    deadline = time.monotonic() + timeout
    poll = WAIT_POLL_FIRST
    with _tasks(source, table) as conn:
        while True:
            row = _read(conn, table, task_id)
            if row is None:
                raise task_gone(task_id)
            if task_finished(row):
                return row
            left = deadline - time.monotonic()
            if left <= 0:
                raise task_late(task_id, timeout, row)
            time.sleep(min(poll, left))
            poll = min(poll * 2, WAIT_POLL_CAP)


async def await_result(
    source: Any,
    table: str,
    task_id: int,
    timeout: float,  # noqa: ASYNC109 (the twin of wait_result's signature)
) -> dict[str, Any]:
    """:func:`wait_result` for asyncio: a DSN or an autocommit aiomysql connection."""
    import aiomysql

    from outboxkit.backends.mariadb.sql import connect_args

    _autocommit(source, "await_result")
    own = isinstance(source, str)
    if own:
        args = connect_args(source)
        args["db"] = args.pop("database")
        conn = await aiomysql.connect(**args, autocommit=True)
    else:
        conn = source
    statement = TaskStatements(table).read_result
    deadline = time.monotonic() + timeout
    poll = WAIT_POLL_FIRST
    try:
        while True:
            async with conn.cursor() as cur:
                await cur.execute(statement, (task_id,))
                found = await cur.fetchone()
                names = [d[0] for d in cur.description]
            if found is None:
                raise task_gone(task_id)
            row = result_row(names, found)
            if task_finished(row):
                return row
            left = deadline - time.monotonic()
            if left <= 0:
                raise task_late(task_id, timeout, row)
            await asyncio.sleep(min(poll, left))
            poll = min(poll * 2, WAIT_POLL_CAP)
    finally:
        if own:
            conn.close()


def _switch(source: Any, table: str, queue: str, paused: bool, by: str | None) -> bool | None:
    """Set ``queue``'s pause row; whether it was paused before (None: it had no row)."""
    sq = TaskStatements(table)
    with _tasks(source, table) as conn, conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(sq.queue_paused_locked, (queue,))
        before = cur.fetchone()
        cur.execute(sq.set_queue_paused, (queue, paused, by, paused, by))
        cur.execute("COMMIT")
    return None if before is None else bool(before[0])


def pause_queue(source: Any, table: str, queue: str, *, by: str | None = None) -> bool:
    """Stop every worker claiming from ``queue`` (running tasks finish; enqueue goes on);
    False if it was paused already."""
    return not _switch(source, table, queue, True, by)


def resume_queue(source: Any, table: str, queue: str, *, by: str | None = None) -> bool:
    """Let workers claim from ``queue`` again (they poll: no wake-up across processes);
    False if it was not paused."""
    return bool(_switch(source, table, queue, False, by))
