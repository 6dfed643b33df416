"""Django Tasks framework ``@task`` functions run by outboxkit's backend in the tests.

With OUTBOXKIT_TEST_SIGNALS_LOG set, the framework's ``task_started`` and ``task_finished``
signals are written there, one line each (``started ID RUNNING``): the worker, which imports
this module to run a task, connects them then.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from django.tasks import task  # type: ignore[import-not-found,unused-ignore]
    from django.tasks.signals import task_finished, task_started  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    from django_tasks import task  # type: ignore[import-not-found,unused-ignore,no-redef]
    from django_tasks.signals import task_finished, task_started  # type: ignore[import-not-found,unused-ignore,no-redef]


class ReportFailed(Exception):
    pass


@task()  # type: ignore[misc]
def add(a: int, b: int) -> int:
    return a + b


@task()  # type: ignore[misc]
async def add_async(a: int, b: int) -> int:
    return a + b


@task(takes_context=True)  # type: ignore[misc]
def attempt(context: Any) -> int:
    return int(context.attempt)


@task()  # type: ignore[misc]
def fail() -> None:
    raise ReportFailed("the report failed")


def _log(event: str) -> Any:
    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        with open(os.environ["OUTBOXKIT_TEST_SIGNALS_LOG"], "a") as log:
            log.write(f"{event} {task_result.id} {task_result.status}\n")

    return receiver


if os.environ.get("OUTBOXKIT_TEST_SIGNALS_LOG"):
    _started, _finished = _log("started"), _log("finished")
    task_started.connect(_started)
    task_finished.connect(_finished)


@task()  # type: ignore[misc]
def create_group(name: str) -> dict[str, Any]:
    """A task that writes through the worker's own Django connection (the ORM); says which
    driver that connection is on."""
    from django.contrib.auth.models import Group
    from django.db import connection

    group = Group.objects.create(name=name)
    return {"id": group.id, "driver": type(connection.connection).__module__}
