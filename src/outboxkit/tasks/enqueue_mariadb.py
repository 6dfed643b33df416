"""``Tasks.enqueue`` on a MariaDB/MySQL connection: the caller's transaction, its driver.

The registry checks and encodes a task once (tasks/registry.py); this runs its statements
(backends/mariadb/tasks_sql.py) through the write side's driver adapters (PyMySQL,
mysqlclient, aiomysql, asyncmy, SQLAlchemy), so it commits or rolls back with the caller's
change. A plain enqueue
is one ``INSERT … RETURNING id``; with ``after=`` MariaDB has no writing CTE, so it is four
statements (mark the upstream tasks, read which exist, insert, insert the edges). No NOTIFY:
an enqueue of a task due now wakes this process's waiting worker (wakeup.writing).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from outboxkit.backends.mariadb import wakeup
from outboxkit.backends.mariadb.sql import with_ids
from outboxkit.backends.mariadb.tasks_sql import PENDING, WAITING, TaskStatements
from outboxkit.drivers import AsyncAdapter, Statement, SyncAdapter
from outboxkit.queue.tasks import TaskStatus


def _stmt(text: str) -> Statement:
    return Statement(text, text)


def _values(params: Sequence[Any]) -> list[Any]:
    """The registry's enqueue parameters as the INSERT's: a run-at time naive UTC, the
    delay in microseconds."""
    name, queue, payload, priority, key, unique_key, max_attempts, at, seconds, trace = params[:10]
    if at is not None:
        at = at.astimezone(dt.UTC).replace(tzinfo=None)
    return [name, queue, payload, priority, key, unique_key, max_attempts, at,
            round(seconds * 1_000_000), trace]  # fmt: skip


class MariaDBTaskEnqueue:
    """One task table's enqueue on MariaDB/MySQL (sync and async adapters alike)."""

    def __init__(self, table: str) -> None:
        self.table = table
        sq = TaskStatements(table)
        self._one = _stmt(sq.enqueue)
        self._mark = sq.mark_upstream
        self._present = sq.upstream_present
        self._after = _stmt(sq.enqueue_after)
        self._edges = sq.insert_edges

    def _woken(self, task_id: Any, seconds: float, at: dt.datetime | None) -> int | None:
        if task_id is None:
            return None
        if at is None and seconds <= 0:
            wakeup.writing(self.table)
        return int(task_id)

    def _edge_statement(self, task_id: int, upstream: Sequence[int]) -> tuple[Statement, list[int]]:
        text = self._edges + ", ".join(["(%s, %s)"] * len(upstream))
        return _stmt(text), [v for a in upstream for v in (task_id, a)]

    def enqueue(
        self,
        adapter: SyncAdapter,
        conn: Any,
        params: Sequence[Any],
        after: Sequence[int] = (),
        after_failure: int = 0,
    ) -> int | None:
        values = _values(params)
        if not after:
            task_id = adapter.fetch_value(conn, self._one, [values[4], *values])
            return self._woken(task_id, params[8], params[7])
        ids = list(after)
        adapter.execute(conn, _stmt(with_ids(self._mark, len(ids))), ids, None)
        states = adapter.fetch_value(conn, _stmt(with_ids(self._present, len(ids))), ids)
        status = self._status(ids, states)
        task_id = int(adapter.fetch_value(conn, self._after, [status, after_failure, *values]))
        adapter.execute(conn, *self._edge_statement(task_id, ids), None)
        return self._woken(task_id, params[8], params[7]) if status == PENDING else task_id

    async def aenqueue(
        self,
        adapter: AsyncAdapter,
        conn: Any,
        params: Sequence[Any],
        after: Sequence[int] = (),
        after_failure: int = 0,
    ) -> int | None:
        values = _values(params)
        if not after:
            task_id = await adapter.fetch_value(conn, self._one, [values[4], *values])
            return self._woken(task_id, params[8], params[7])
        ids = list(after)
        await adapter.execute(conn, _stmt(with_ids(self._mark, len(ids))), ids, None)
        states = await adapter.fetch_value(conn, _stmt(with_ids(self._present, len(ids))), ids)
        status = self._status(ids, states)
        task_id = int(
            await adapter.fetch_value(conn, self._after, [status, after_failure, *values])
        )
        await adapter.execute(conn, *self._edge_statement(task_id, ids), None)
        return self._woken(task_id, params[8], params[7]) if status == PENDING else task_id

    @staticmethod
    def _status(ids: Sequence[int], states: Any) -> int:
        """Pending if every upstream task is done, else waiting; LookupError if one is
        not in the table (``states``: ``upstream_present``'s "id:status,…")."""
        found = {}
        text = states.decode() if isinstance(states, bytes) else states or ""
        for pair in filter(None, text.split(",")):
            task_id, status = pair.split(":")
            found[int(task_id)] = int(status)
        missing = sorted(set(ids) - found.keys())
        if missing:  # (the registry says it in words: _upstream_refusal)
            raise LookupError(f"outboxkit: no upstream task {', '.join(map(str, missing))}")
        done = all(s == TaskStatus.DONE for s in found.values())
        return PENDING if done else WAITING


# -- tasks sent with the COMMIT (Tasks.transaction()) ------------------------------------


class MariaDBTaskStorage:
    """What write/mariadb_commit.py's transaction asks of a storage, for task rows:
    ``Tasks.transaction()``'s enqueues, each the plain enqueue's ``INSERT … RETURNING id``
    (its key lock and its waiting-behind-the-key status are per row), joined into one
    multi-statement query sent with the COMMIT, split under ``max_allowed_packet`` as the
    outbox's INSERTs are."""

    def __init__(self, table: str) -> None:
        self.table = table
        self._text = TaskStatements(table).enqueue
        #: Its ``%s`` (the key's lock slot, then the enqueue's values).
        self._placeholders = self._text.count("%s")

    @staticmethod
    def row(params: Sequence[Any]) -> tuple[Any, ...]:
        """An enqueue's parameters (the registry's) as the statement's values."""
        values = _values(params)
        return (values[4], *values)

    @staticmethod
    def slots(rows: list[tuple[Any, ...]]) -> list[int]:
        return []  # (each enqueue locks its own key)

    def shape(self, slots: int) -> tuple[int, int]:
        """(fixed, per row): a query's bytes besides the values (write/mariadb_packet.py)."""
        return 0, len(self._text) - 2 * self._placeholders + 2  # statements joined by ";\n"

    def insert(self, rows: list[tuple[Any, ...]], slots: list[int] | None = None) -> Any:
        """The enqueues of ``rows`` as one multi-statement text, each returning its id."""
        text = ";\n".join([self._text] * len(rows))
        return Statement(text, text), [value for row in rows for value in row]

    @staticmethod
    def due(rows: list[tuple[Any, ...]]) -> bool:
        """Whether any task is due now (no run-at time, no delay): only those wake."""
        return any(row[8] is None and row[9] <= 0 for row in rows)

    def committed(self, rows: list[tuple[Any, ...]]) -> None:
        """These rows were committed: if any is due now, this process's waiting worker
        claims at once (MariaDB has no NOTIFY)."""
        if rows and self.due(rows):
            wakeup.committed(self.table)
