"""``Tasks.enqueue`` on a PostgreSQL connection: one statement in the caller's transaction.

``ENQUEUE`` (or ``ENQUEUE_AFTER`` with upstream tasks) of backends/postgres/tasks_sql.py,
run through the driver adapters; the statement itself wakes a waiting worker (NOTIFY).
Here, not in backends/, as the outbox's storages live in write/: the layers put tasks
above the backends and the drivers it joins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outboxkit.backends.postgres.tasks_sql import TaskStatements
from outboxkit.drivers import AsyncAdapter, Statement, SyncAdapter

#: The registry's enqueue parameters, by name (tasks_sql.py ENQUEUE_AFTER names them).
_NAMES = ("task_name", "queue", "payload", "priority", "key", "unique_key", "max_attempts",
          "run_at", "delay", "trace")  # fmt: skip


class PgTaskEnqueue:
    """One task table's enqueue on PostgreSQL (sync and async adapters alike)."""

    def __init__(self, table: str) -> None:
        sq = TaskStatements(table)
        self._channel = sq.channel
        self._one = Statement(sq.enqueue, sq.enqueue_dollar)
        self._after = Statement(sq.enqueue_after, sq.enqueue_after_dollar)
        self._after_names = sq.enqueue_after_names

    def _statement(
        self, params: Sequence[Any], after: Sequence[int], after_failure: int
    ) -> tuple[Statement, list[Any]]:
        if not after:
            return self._one, [*params, self._channel]
        named = dict(zip(_NAMES, params, strict=True))
        named.update(channel=self._channel, after=list(after), after_failure=after_failure)
        return self._after, [named[n] for n in self._after_names]

    def enqueue(
        self,
        adapter: SyncAdapter,
        conn: Any,
        params: Sequence[Any],
        after: Sequence[int] = (),
        after_failure: int = 0,
    ) -> Any:
        return adapter.fetch_value(conn, *self._statement(params, after, after_failure))

    async def aenqueue(
        self,
        adapter: AsyncAdapter,
        conn: Any,
        params: Sequence[Any],
        after: Sequence[int] = (),
        after_failure: int = 0,
    ) -> Any:
        return await adapter.fetch_value(conn, *self._statement(params, after, after_failure))
