"""A task app for MariaDB worker processes the tests start and SIGKILL
(`--app tests.support.mariadb_tasks_app:tasks`, the database in ``OUTBOXKIT_DSN``).

Each run is recorded in ``task_runs`` on its own autocommit connection before the handler
does anything, so a test sees the runs of processes it killed. ``effect`` writes its effect
in the handler's fenced transaction (``ctx.transaction()``); ``naive_effect`` commits its
effect on its own, then completes: the way that double-applies when a worker dies between.
Both hold their first attempt for ``hold`` seconds (a test kills the worker then).
``per_key`` (``concurrency_per_key=2``) and ``naive_per_key`` (a semaphore of 2 per key in
each process) record each run's start and end in ``keyed_runs`` by the database's clock.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pymysql

from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.tasks import TaskContext, Tasks

tasks = Tasks()

DDL = (
    "CREATE TABLE IF NOT EXISTS task_runs (task_id BIGINT, attempt INT, pid INT)",
    "CREATE TABLE IF NOT EXISTS effects (n INT, task_id BIGINT, attempt INT)",
    "CREATE TABLE IF NOT EXISTS keyed_runs (id BIGINT AUTO_INCREMENT PRIMARY KEY,"
    " task_id BIGINT, `key` VARCHAR(100), pid INT,"
    " started DATETIME(6) DEFAULT (UTC_TIMESTAMP(6)), ended DATETIME(6))",
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


def _run_keyed(ctx: TaskContext, key: str, seconds: float) -> None:
    """Records the run's start and end by the database's clock (the test counts the overlap
    per key), sleeping between them."""
    conn = _connect(True)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "INSERT INTO keyed_runs (task_id, `key`, pid) VALUES (%s, %s, %s)",
                (ctx.id, key, os.getpid()),
            )
            run = cur.lastrowid
            time.sleep(seconds)
            cur.execute("UPDATE keyed_runs SET ended = UTC_TIMESTAMP(6) WHERE id = %s", (run,))
    finally:
        conn.close()


@tasks.handler("per_key", concurrency_per_key=2)
def per_key(payload: dict[str, float], ctx: TaskContext) -> None:
    """At most 2 of one key at once across every worker (the claim in the database)."""
    assert ctx.key is not None
    _run_keyed(ctx, ctx.key, payload["seconds"])


_KEY_SLOTS: dict[str, threading.Semaphore] = {}
_SLOTS_LOCK = threading.Lock()


@tasks.handler("naive_per_key")
def naive_per_key(payload: dict[str, Any], ctx: TaskContext) -> None:
    """The naive per-key limit: a semaphore of 2 per key in each worker process (the tasks
    are enqueued without a key; the payload names it)."""
    key = str(payload["key"])
    with _SLOTS_LOCK:
        slots = _KEY_SLOTS.setdefault(key, threading.Semaphore(2))
    with slots:
        _run_keyed(ctx, key, float(payload["seconds"]))
