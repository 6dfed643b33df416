"""``tasks``: task mode's ``Tasks`` on Django's connections, enqueued inside ``atomic()``.

On Django's psycopg 3 backend an enqueue rides with the outermost block's COMMIT, in the same
queue as the outbox's events (``deferred.py``): no round trip of its own, dropped with a
rollback or a rollback to a savepoint taken before it. Elsewhere (psycopg2, Django's
``TestCase``, ``WRITE_WITH_COMMIT: False``) it is one INSERT in the block, at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outboxkit.contrib.django import conf, deferred
from outboxkit.contrib.django.db import atomic_connection
from outboxkit.errors import ConfigurationError
from outboxkit.tasks import Tasks

#: What ``manage.py outboxkit_worker`` hands ``outboxkit worker --app`` (set by the command).
worker_app: Tasks | None = None


@dataclass(frozen=True, slots=True)
class Enqueued:
    """One checked enqueue waiting for the COMMIT."""

    name: str
    payload: Any
    options: dict[str, Any] = field(default_factory=dict)


class _Batch:
    def __init__(self, tx: Any) -> None:
        self._tx = tx

    def put_many(self, calls: Iterable[Enqueued]) -> None:
        for c in calls:
            self._tx.enqueue(c.name, c.payload, **c.options)


class TaskWriter:
    """deferred.py's ``Writer`` for tasks: ``Tasks.transaction()``'s pipeline at the COMMIT
    (synchronous only, as Django's ``atomic()`` is: no async half to refuse)."""

    def __init__(self, tasks: Tasks) -> None:
        self.tasks = tasks

    @contextmanager
    def transaction(self, conn: psycopg.Connection[Any]) -> Iterator[_Batch]:
        with self.tasks.transaction(conn) as tx:
            yield _Batch(tx)

    def put_many(self, conn: Any, events: Iterable[Any]) -> None:
        for c in events:  # Enqueued (the Writer protocol names them events)
            self.tasks.enqueue(conn, c.name, c.payload, **c.options)


class DjangoTasks:
    """Task mode on ``settings.OUTBOXKIT['TASKS_TABLE']``, enqueued through Django::

        @tasks.handler("report.generate")
        def generate(payload): ...

        with transaction.atomic():
            report = Report.objects.create(...)
            tasks.enqueue("report.generate", {"id": report.id})

    ``manage.py outboxkit_worker`` runs the handlers (it imports each app's ``tasks`` module,
    or ``--app module:attribute``). The table is read from the settings on first use.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: Tasks | None = None
        self._writer: TaskWriter | None = None

    @property
    def tasks(self) -> Tasks:
        """The library's :class:`~outboxkit.tasks.Tasks` (for ``outboxkit worker --app``)."""
        found = self._tasks
        if found is None:
            with self._lock:
                if self._tasks is None:
                    table = conf.get().TASKS_TABLE
                    if table is None:
                        raise ConfigurationError(
                            "settings.OUTBOXKIT['TASKS_TABLE'] is None: set it to the task"
                            " table (the app's migrations create it) to use task mode"
                        )
                    self._tasks = Tasks(table)
                    self._writer = TaskWriter(self._tasks)
                found = self._tasks
        return found

    def handler(self, name: str, **options: Any) -> Callable[[Any], Any]:
        """``Tasks.handler``: register ``fn(payload)`` or ``fn(payload, ctx)`` for ``name``."""
        return self.tasks.handler(name, **options)

    def periodic(self, cron: str, name: str | None = None, **options: Any) -> Callable[[Any], Any]:
        """``Tasks.periodic``: register the function and run it at every slot of ``cron``."""
        return self.tasks.periodic(cron, name, **options)

    def periodic_task(self, cron: str, name: str, payload: Any = None, **options: Any) -> None:
        """``Tasks.periodic_task``: run task ``name`` at every slot of ``cron``."""
        self.tasks.periodic_task(cron, name, payload, **options)

    def enqueue(
        self, name: str, payload: Any = None, *, using: str | None = None, **options: Any
    ) -> int | None:
        """Enqueue task ``name`` in the open ``transaction.atomic()`` block of ``using``.

        Checked now (an unknown task or a bad payload fails here). ``options``: those of
        ``Tasks.enqueue`` (``delay``, ``run_at``, ``unique_key``, ``priority``, ``queue``,
        ``key``, ``max_attempts``). Written with the block's COMMIT on psycopg 3: returns
        None (no id before the COMMIT; a taken ``unique_key`` is skipped then, unsaid);
        written at once elsewhere: the task's id, or None if ``unique_key`` was taken.
        """
        tasks = self.tasks
        conn = atomic_connection(using, "enqueue a task")
        call = Enqueued(name, payload, options)
        _check(tasks, call)
        # after= checks its upstream tasks in its own statement: written at once.
        if conf.get().WRITE_WITH_COMMIT and deferred.defers(conn) and "after" not in options:
            assert self._writer is not None
            deferred.queue_calls(conn, self._writer, [call])
            return None
        with conn.wrap_database_errors:
            return tasks.enqueue(conn.connection, name, payload, **options)

    def __repr__(self) -> str:
        return f"<outboxkit.contrib.django tasks {conf.get().TASKS_TABLE!r}>"


def _check(tasks: Tasks, call: Enqueued) -> None:
    """Validate now what the COMMIT would refuse (the same checks as ``Tasks.enqueue``)."""
    from outboxkit.tasks.registry import _options

    _options(tasks, call.name, call.payload, call.options)
