"""A task app whose handlers opt in to lifecycle events, for MariaDB worker processes the
tests start and freeze (`--app tests.support.mariadb_task_events_app:tasks`, the database
in ``OUTBOXKIT_DSN``, the events' topic in ``EVENTS_TOPIC``).

Each run is recorded in ``task_runs`` first (mariadb_tasks_app.py's table), on its own
autocommit connection, so a test sees the runs of a process it froze.
"""

from __future__ import annotations

import os
import time
from typing import Any

from outboxkit.tasks import TaskContext, Tasks
from tests.support.mariadb_tasks_app import DDL, _record

__all__ = ["DDL", "tasks"]

TOPIC = os.environ.get("EVENTS_TOPIC", "task-events")

tasks = Tasks()


@tasks.handler("ev.ok", events=TOPIC)
def ok(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Succeeds: task.completed, written by the settle."""
    _record(ctx)


@tasks.handler("ev.flaky", events=TOPIC, retry=[0.05], max_attempts=3)
def flaky(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Fails its first attempt (task.failed), then succeeds (task.completed)."""
    _record(ctx)
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")


@tasks.handler("ev.dead", events=TOPIC, max_attempts=1)
def dead(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Fails its only attempt: task.dead_lettered."""
    _record(ctx)
    raise RuntimeError("always fails")


@tasks.handler("ev.slow", events=TOPIC)
def slow(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Holds its first attempt ``hold`` seconds (a test freezes its worker meanwhile)."""
    _record(ctx)
    if ctx.attempt == 1:
        time.sleep(payload.get("hold", 0))
