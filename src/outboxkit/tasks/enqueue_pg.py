"""``Tasks.enqueue`` on a PostgreSQL connection: one statement in the caller's transaction.

``ENQUEUE`` (or ``ENQUEUE_AFTER`` with upstream tasks) of backends/postgres/tasks_sql.py,
run through the driver adapters; the statement itself wakes a waiting worker (NOTIFY). And
``Tasks.transaction()``'s enqueues, sent with the COMMIT in PostgreSQL's binary formats
(:class:`PgTaskStorage`, :func:`pg_task_row`). Here, not in backends/, as the outbox's
storages live in write/: the layers put tasks above the backends and the drivers it joins.
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Sequence
from typing import Any

from outboxkit.backends.postgres.tasks_sql import TaskStatements
from outboxkit.drivers import AsyncAdapter, Statement, SyncAdapter
from outboxkit.errors import NotInTransactionError
from outboxkit.write.storage import BinaryRow, CommitStatement, Send, commit_statement

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


# -- tasks sent with the COMMIT (Tasks.transaction()) ------------------------------------


class PgTaskStorage:
    """What write/commit.py's pipeline asks of a storage, for task rows (one INSERT each):
    ``Tasks.transaction()``'s enqueues sent with the COMMIT."""

    def __init__(self, table: str, *, notify: bool) -> None:
        self.table = table
        self.notify = notify
        sq = TaskStatements(table)
        self._channel = sq.channel.encode()
        # text, text, jsonb, int2, text, text, int4, timestamptz, float8, text, text
        types = [25, 25, 3802, 21, 25, 25, 23, 1184, 701, 25, 25]
        self._insert = commit_statement(sq.enqueue_with_commit, types, b"outboxkit_task")

    def encode(self, event: object) -> BinaryRow:
        raise NotInTransactionError(
            "a task transaction queues tasks (tx.enqueue); write outbox events inside its block"
            " with outbox.put(tx.connection, event)"
        )

    def commit_inserts(self, rows: list[BinaryRow], send: Send) -> None:
        for row in rows:
            send(self._insert, [*row, self._channel])

    def prepared(self) -> list[CommitStatement]:
        return [self._insert]


def pg_task_row(params: list[Any]) -> BinaryRow:
    """An enqueue's parameters (without the channel) in PostgreSQL's binary formats."""
    name, queue, document, priority, key, unique_key, max_attempts, at, seconds, trace = params[:10]
    return [
        name.encode(),
        queue.encode(),
        b"\x01" + document.encode(),
        priority.to_bytes(2, "big", signed=True),
        None if key is None else key.encode(),
        None if unique_key is None else unique_key.encode(),
        None if max_attempts is None else max_attempts.to_bytes(4, "big", signed=True),
        None if at is None else _timestamptz(at),
        struct.pack(">d", seconds),
        None if trace is None else trace.encode(),
    ]


_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


def _timestamptz(value: dt.datetime) -> bytes:
    micros = (value - _PG_EPOCH) // dt.timedelta(microseconds=1)
    return int(micros).to_bytes(8, "big", signed=True)
