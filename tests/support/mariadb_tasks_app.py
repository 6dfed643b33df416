"""A task app for MariaDB worker processes the tests start and SIGKILL
(`--app tests.support.mariadb_tasks_app:tasks`, the database in ``OUTBOXKIT_DSN``).

Each run is recorded in ``task_runs`` on its own autocommit connection before the handler
does anything, so a test sees the runs of processes it killed. ``effect`` writes its effect
in the handler's fenced transaction (``ctx.transaction()``); ``naive_effect`` commits its
effect on its own, then completes: the way that double-applies when a worker dies between.
Both hold their first attempt for ``hold`` seconds (a test kills the worker then).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pymysql

from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.tasks import TaskContext, Tasks

tasks = Tasks()

DDL = (
    "CREATE TABLE IF NOT EXISTS task_runs (task_id BIGINT, attempt INT, pid INT)",
    "CREATE TABLE IF NOT EXISTS effects (n INT, task_id BIGINT, attempt INT)",
)


def _connect(autocommit: bool) -> Any:
    return pymysql.connect(**connect_args(os.environ["OUTBOXKIT_DSN"]), autocommit=autocommit)


def _record(ctx: TaskContext) -> None:
    conn = _connect(True)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "INSERT INTO task_runs VALUES (%s, %s, %s)", (ctx.id, ctx.attempt, os.getpid())
            )
    finally:
        conn.close()


@tasks.handler("effect")
def effect(payload: dict[str, Any], ctx: TaskContext) -> None:
    """The effect and the task's completion commit together, fenced by the claim token."""
    _record(ctx)
    with ctx.transaction() as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO effects VALUES (%s, %s, %s)", (payload["n"], ctx.id, ctx.attempt))
        if ctx.attempt == 1:
            time.sleep(payload.get("hold", 0))


@tasks.handler("naive_effect")
def naive_effect(payload: dict[str, Any], ctx: TaskContext) -> None:
    """The effect commits on its own; the completion follows (the settle) - or not."""
    _record(ctx)
    conn = _connect(True)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "INSERT INTO effects VALUES (%s, %s, %s)", (payload["n"], ctx.id, ctx.attempt)
            )
    finally:
        conn.close()
    if ctx.attempt == 1:
        time.sleep(payload.get("hold", 0))
