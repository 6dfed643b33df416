"""What a handler gets beside its payload: the task's identity, and effects that happen once.

``ctx.transaction()`` (sync handlers) / ``ctx.atransaction()`` (async ones) open a
transaction whose last statement completes the task, fenced by the claim token: if this
attempt lost its lease meanwhile (a hung worker, another one re-ran the task) the
completion matches no row and the whole transaction is rolled back, so a zombie attempt's
writes never land. ``ctx.outbox.put(event)`` inside it writes outbox events in that same
transaction.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from outboxkit.errors import NotInTransactionError
from outboxkit.events import Event
from outboxkit.queue.tasks import ClaimedTask, TaskStore
from outboxkit.tasks.errors import LeaseLost
from outboxkit.tasks.progress import ProgressWriter, encode_progress
from outboxkit.tasks.results import TaskResult, dependency_from_row
from outboxkit.write.outbox import Outbox


class BoundOutbox:
    """``ctx.outbox``: the worker's Outbox on the connection of the open ``ctx.transaction()``."""

    def __init__(self, ctx: TaskContext) -> None:
        self._ctx = ctx

    def put(self, event: Event) -> None:
        conn = self._ctx._sync_conn
        if conn is None:
            raise NotInTransactionError("ctx.outbox.put() belongs inside `with ctx.transaction():`")
        self._ctx.outbox_of_worker.put(conn, event)

    async def aput(self, event: Event) -> None:
        conn = self._ctx._async_conn
        if conn is None:
            raise NotInTransactionError(
                "ctx.outbox.aput() belongs inside `async with ctx.atransaction():`"
            )
        await self._ctx.outbox_of_worker.aput(conn, event)


class TaskContext:
    """The running task: ``id`` and ``attempt`` (together an idempotency key), its name,
    queue and key; ``transaction()`` / ``atransaction()`` for effects fenced by the claim."""

    def __init__(
        self,
        task: ClaimedTask,
        token: uuid.UUID,
        *,
        store: TaskStore,
        outbox: Outbox,
        worker_id: str,
        events: str | None = None,
        progress: ProgressWriter | None = None,
    ) -> None:
        self.task = task
        self._events = events
        self._report = progress
        self.id = task.id
        self.attempt = task.attempt
        self.name = task.task_name
        self.queue = task.queue
        self.key = task.key
        self.token = token
        self.worker_id = worker_id
        self.outbox_of_worker = outbox
        self.outbox = BoundOutbox(self)
        self._store = store  # its transactions and the fenced completion
        #: Set when the task is no longer this attempt's (cancelled, or re-claimed after
        #: the lease ran out): a long sync handler checks it to stop early.
        self.cancelled = threading.Event()
        self._sync_conn: Any = None
        self._async_conn: Any = None

    def __repr__(self) -> str:
        return f"TaskContext(id={self.id}, name={self.name!r}, attempt={self.attempt})"

    def progress(self, value: Any) -> None:
        """Report how far the task is: a fraction from 0 to 1, or a small JSON object
        (``{"done": 40, "of": 200}``). Cheap to call often: the worker writes the last value
        at most every second (tasks/progress.py), fenced by this attempt's claim; readers
        see it in ``Tasks.result()``, ``outboxkit tasks show`` and the dashboard."""
        if self._report is None:
            encode_progress(value)  # checked as a worker would, though nothing writes it
            return
        self._report.report(self.id, self.token, value)

    def dependencies(self) -> list[TaskResult]:
        """The tasks this one waited for (``after=``), by id: each one's result (a done task
        whose handler keeps no result is gone: it comes back done, with no value)."""
        with self._store.transaction(f"{self.name}:dependencies") as conn:
            rows = self._store.dependencies(conn, self.id)
        return [dependency_from_row(r) for r in rows]

    async def adependencies(self) -> list[TaskResult]:
        """The async twin of :meth:`dependencies`."""
        async with self._store.atransaction(f"{self.name}:dependencies") as conn:
            rows = await self._store.adependencies(conn, self.id)
        return [dependency_from_row(r) for r in rows]

    def _last_progress(self) -> str | None:
        """The last progress not written yet: a kept completion writes it."""
        if self._report is None or self.task.keep is None:
            return None
        return self._report.take(self.id)

    def _lost(self) -> LeaseLost:
        return LeaseLost(
            f"task {self.id} ({self.name}, attempt {self.attempt}) was re-claimed by another"
            " worker after this attempt's lease ran out: its transaction was rolled back"
        )

    def _completed_event(self) -> Event:
        from outboxkit.tasks.lifecycle import lifecycle_event

        assert self._events is not None
        return lifecycle_event(self.task, "completed", self._events)

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A transaction (a psycopg connection on PostgreSQL) that commits with the task's
        completion (fenced), or not at all."""
        with self._store.transaction(self.name) as conn:
            try:
                self._sync_conn = conn
                yield conn
                last = self._last_progress()
                if not self._store.complete(conn, self.id, self.token, self.task.keep, last):
                    conn.rollback()
                    raise self._lost()
                if self._events is not None:
                    self.outbox_of_worker.put(conn, self._completed_event())
                conn.commit()
                self.task.completed = True
            finally:
                self._sync_conn = None

    @asynccontextmanager
    async def atransaction(self) -> AsyncIterator[Any]:
        """The async twin of :meth:`transaction`."""
        async with self._store.atransaction(self.name) as conn:
            try:
                self._async_conn = conn
                yield conn
                last = self._last_progress()
                if not await self._store.acomplete(conn, self.id, self.token, self.task.keep, last):
                    await conn.rollback()
                    raise self._lost()
                if self._events is not None:
                    await self.outbox_of_worker.aput(conn, self._completed_event())
                await conn.commit()
                self.task.completed = True
            finally:
                self._async_conn = None
