"""A backend for Django's Tasks framework (``django.tasks``, or the ``django-tasks`` backport).

Named ``tasks_backend``, not ``tasks``: the app's ``ready()`` imports every installed app's
``tasks`` module (where handlers register), so a ``tasks`` module here would import the
framework in every project using the app, whether or not it has it installed.

Every ``@task`` runs through one task-mode handler, ``django.task``, which imports the task by
its path: ``manage.py outboxkit_worker`` runs them with the project's settings. The enqueue is
a row in the caller's ``atomic()`` block (rolled back: never runs; no ``on_commit``).
"""

from __future__ import annotations

import datetime
import json
import traceback
from importlib.util import find_spec
from typing import Any

import psycopg
from django.db import connections, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

# Django 6.0's own framework where it exists, else the backport: the same names, but for
# InvalidTask (the backport's InvalidTaskError). Chosen by find_spec, not by an ImportError,
# so a renamed name on Django 6 fails loudly instead of falling back to a missing backport.
if find_spec("django.tasks") is not None:
    from django.tasks import TaskContext, TaskResult, TaskResultStatus  # type: ignore[import-not-found,unused-ignore]
    from django.tasks.backends.base import BaseTaskBackend  # type: ignore[import-not-found,unused-ignore]
    from django.tasks.base import TaskError  # type: ignore[import-not-found,unused-ignore]
    from django.tasks.exceptions import InvalidTask as InvalidTaskError  # type: ignore[import-not-found,unused-ignore]
    from django.tasks.exceptions import TaskResultDoesNotExist  # type: ignore[import-not-found,unused-ignore]
    from django.tasks.signals import task_enqueued, task_finished, task_started  # type: ignore[import-not-found,unused-ignore]
else:  # Django 5.2 with the backport
    from django_tasks import TaskContext, TaskResult, TaskResultStatus  # type: ignore[import-not-found,unused-ignore,no-redef]
    from django_tasks.backends.base import BaseTaskBackend  # type: ignore[import-not-found,unused-ignore,no-redef]
    from django_tasks.base import TaskError  # type: ignore[import-not-found,unused-ignore,no-redef]
    from django_tasks.exceptions import (  # type: ignore[import-not-found,unused-ignore,no-redef]
        InvalidTaskError,
        TaskResultDoesNotExist,
    )
    from django_tasks.signals import task_enqueued, task_finished, task_started  # type: ignore[import-not-found,unused-ignore,no-redef]

from outboxkit.backends import backend_for, backend_of
from outboxkit.backends.ports import TaskAdmin
from outboxkit.contrib.django import tasks as _tasks
from outboxkit.contrib.django.db import dsn_for
from outboxkit.tasks.context import TaskContext as _OutboxkitContext
from outboxkit.tasks.results import TaskResult as _OutboxkitResult

#: The task-mode handler that runs every Django ``@task``.
HANDLER = "django.task"

_STATUS = {
    "queued": "READY",
    "scheduled": "READY",
    "waiting": "READY",
    "running": "RUNNING",
    "done": "SUCCESSFUL",
    "failed": "FAILED",
    "cancelled": "FAILED",
}


def _run(payload: dict[str, Any], ctx: _OutboxkitContext) -> Any:
    """Import the ``@task`` by its path and call it (async ones through ``Task.call``),
    sending the framework's ``task_started`` and ``task_finished`` signals around it."""
    task = _task(payload)
    args, kwargs = payload["args"], payload["kwargs"]
    result = _pending(
        task, str(ctx.id), args, kwargs, attempts=ctx.attempt, alias=payload["backend"]
    )
    started = timezone.now()
    _set(result, status=TaskResultStatus.RUNNING, started_at=started, last_attempted_at=started)
    task_started.send(sender=OutboxkitBackend, task_result=result)
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
    except Exception as exc:
        # Sent inside the handler, as Django's backends do: its log receiver adds exc_info.
        result.errors.append(
            TaskError(
                exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
                traceback="".join(traceback.format_exception(exc)),
            )
        )
        _set(result, status=TaskResultStatus.FAILED, finished_at=timezone.now())
        task_finished.send(sender=OutboxkitBackend, task_result=result)
        raise
    _set(
        result, status=TaskResultStatus.SUCCESSFUL, finished_at=timezone.now(), _return_value=value
    )
    task_finished.send(sender=OutboxkitBackend, task_result=result)
    return value


def _set(result: Any, **fields: Any) -> None:
    """TaskResult is a frozen dataclass: the framework's own backends set it this way."""
    for name, value in fields.items():
        object.__setattr__(result, name, value)


class OutboxkitBackend(BaseTaskBackend):  # type: ignore[misc,unused-ignore]
    """Django's Tasks framework backend on task mode::

        TASKS = {"default": {"BACKEND": "outboxkit.contrib.django.tasks_backend.OutboxkitBackend"}}


    ``OPTIONS``: ``{"DATABASE": alias}`` (default ``"default"``). Priority is task mode's
    (higher first); ``run_after`` is the task's ``run_at``; ``queue_name`` its queue.
    """

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.database: str = self.options.get("DATABASE", "default")
        _register()

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        """Writes the task in the caller's ``atomic()`` block (at once in autocommit)."""
        self.validate_task(task)
        args, kwargs = list(args), dict(kwargs)
        try:
            json.dumps([args, kwargs])
        except (TypeError, ValueError) as exc:
            raise InvalidTaskError(
                f"the arguments of task {task.module_path!r} are not JSON: {exc}"
                " (pass ids, strings and numbers; the task runs in another process)"
            ) from None
        payload = {
            "path": task.module_path,
            "args": args,
            "kwargs": kwargs,
            "backend": self.alias,
            # What .using() changed, for the TaskResult.task the worker and get_result() build.
            "queue_name": task.queue_name,
            "priority": task.priority,
            "run_after": None if task.run_after is None else task.run_after.isoformat(),
        }
        # Django's framework has no retries: one attempt, a failure is final.
        options: dict[str, Any] = {
            "priority": task.priority,
            "queue": task.queue_name,
            "max_attempts": 1,
        }
        if task.run_after is not None:
            options["run_at"] = task.run_after
        # Inside atomic(): a row of the caller's transaction. Outside: its own block, at once.
        # savepoint=False: in a block, no SAVEPOINT round trips around the INSERT (a failed
        # INSERT fails the block, as any failed statement of it would).
        with transaction.atomic(using=self.database, savepoint=False):
            conn = connections[self.database]
            conn.ensure_connection()
            with conn.wrap_database_errors:
                task_id = _tasks.tasks.enqueue(conn.connection, HANDLER, payload, **options)
        result = _pending(task, str(task_id), args, kwargs, attempts=0, alias=self.alias)
        _set(result, enqueued_at=timezone.now())
        # Sent with the row written but maybe not committed (inside the caller's atomic()).
        task_enqueued.send(sender=type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> Any:
        """The task's status, return value or error, read from task mode's stored result."""
        try:
            task_id = int(result_id)
        except ValueError:
            raise TaskResultDoesNotExist(result_id) from None
        source = self._source()
        with connections[self.database].wrap_database_errors:
            found = _tasks.tasks.result(source, task_id)
            if found is None or found.name != HANDLER:
                raise TaskResultDoesNotExist(result_id)
            row = _admin(source).show_task(source, _tasks.tasks.table, task_id)
        if row is None:  # deleted in between (its kept result expired)
            raise TaskResultDoesNotExist(result_id)
        return self._to_django(found, row)

    def _source(self) -> Any:
        """What task mode reads through: Django's psycopg 3 connection (in the caller's
        transaction, if one is open); on another driver (psycopg2, mysqlclient) a DSN, a
        connection of its own that sees committed tasks, each read afresh (a MariaDB
        transaction's snapshot would hold ``refresh()`` back)."""
        conn = connections[self.database]
        conn.ensure_connection()
        if isinstance(conn.connection, psycopg.Connection):
            return conn.connection
        return dsn_for(self.database)

    def _to_django(self, found: _OutboxkitResult, row: dict[str, Any]) -> Any:
        """Django's TaskResult of task-mode result ``found``, its ``@task`` and arguments
        read from the task's payload (``row``: the task's columns, as ``show_task`` reads)."""
        payload = json.loads(row["payload_json"])
        task = _task(payload)
        result = _pending(
            task,
            str(found.id),
            payload["args"],
            payload["kwargs"],
            attempts=found.attempts,
            alias=self.alias,
        )
        _set(
            result,
            status=TaskResultStatus[_STATUS[found.status]],
            enqueued_at=found.enqueued_at,
            started_at=found.started_at,
            last_attempted_at=found.started_at,
            finished_at=found.finished_at,
        )
        if found.status == "done":
            value = found.value
            if isinstance(value, str):  # Django's connections load jsonb as text
                value = json.loads(value)
            _set(result, _return_value=value)
        if found.error is not None and found.status in ("failed", "cancelled"):
            result.errors.append(
                TaskError(
                    exception_class_path=_class_path(found.error.type, found.error.traceback),
                    traceback=found.error.traceback or found.error.message or "",
                )
            )
        return result


def _task(payload: dict[str, Any]) -> Any:
    """The ``@task`` of ``payload["path"]`` with the queue, priority and run_after it was
    enqueued with (a row written before they were recorded gets the decorator's)."""
    task = import_string(payload["path"])
    run_after = payload.get("run_after")
    return task.using(
        queue_name=payload.get("queue_name"),
        priority=payload.get("priority"),
        run_after=None if run_after is None else datetime.datetime.fromisoformat(run_after),
    )


def _pending(
    task: Any, result_id: str, args: Any, kwargs: Any, *, attempts: int, alias: str
) -> Any:
    return TaskResult(
        task=task,
        id=result_id,
        status=TaskResultStatus.READY,
        enqueued_at=None,
        started_at=None,
        last_attempted_at=None,
        finished_at=None,
        args=args,
        kwargs=kwargs,
        backend=alias,
        errors=[],
        worker_ids=["outboxkit"] * attempts,
    )


def _class_path(error_type: str | None, traceback: str | None) -> str:
    """The exception's ``module.Class``: the traceback's last line names it in full."""
    if traceback:
        last = traceback.strip().splitlines()[-1]
        name = last.split(":", 1)[0].strip()
        if name and " " not in name:
            return name if "." in name else f"builtins.{name}"
    name = error_type or "Exception"
    return name if "." in name else f"builtins.{name}"


def _admin(source: Any) -> TaskAdmin:
    """Task mode's reads on ``source``'s database (a DSN or a connection)."""
    return (backend_for(source) if isinstance(source, str) else backend_of(source)).task_admin()


_registered = False


def _register() -> None:
    """Register ``django.task`` once (the worker imports this module through ``ready()``)."""
    global _registered
    if not _registered:
        _tasks.handler(HANDLER, keep_result=True)(_run)
        _registered = True
