"""A task app for worker processes the tests start and kill (`--app tests.support.tasks_app:tasks`).

Each run is recorded in ``task_runs`` on its own autocommit connection before the handler
does anything, so a test sees runs of processes it killed.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg

from outboxkit.tasks import TaskContext, Tasks

tasks = Tasks()

RUNS_DDL = "CREATE TABLE IF NOT EXISTS task_runs (task_id bigint, attempt int, pid int)"


def _record(ctx: TaskContext) -> None:
    with psycopg.connect(os.environ["OUTBOXKIT_DSN"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO task_runs VALUES (%s, %s, %s)", (ctx.id, ctx.attempt, os.getpid())
        )


@tasks.handler("hang_first")
def hang_first(payload: None, ctx: TaskContext) -> None:
    """Hangs on its first attempt (the test kills the worker), returns on the next."""
    _record(ctx)
    if ctx.attempt == 1:
        import time

        time.sleep(120)


@tasks.handler("sleep")
async def sleep(payload: dict[str, float], ctx: TaskContext) -> None:
    _record(ctx)
    await asyncio.sleep(payload["seconds"])


@tasks.handler("effect_once")
def effect_once(payload: None, ctx: TaskContext) -> None:
    """Writes its effect in ctx.transaction(); the first attempt dawdles inside it (the test
    freezes that worker there with SIGSTOP)."""
    import time

    _record(ctx)
    with ctx.transaction() as conn:
        conn.execute("INSERT INTO effects VALUES (%s, %s)", (ctx.id, ctx.attempt))
        if ctx.attempt == 1:
            time.sleep(2)


class PoisonError(BaseException):
    """Not an Exception: what a careless library raises to "stop everything"."""


@tasks.handler("poison.exit")
def poison_exit(payload: None) -> None:
    raise SystemExit(3)


@tasks.handler("poison.interrupt")
async def poison_interrupt(payload: None) -> None:
    raise KeyboardInterrupt


@tasks.handler("poison.base")
def poison_base(payload: None) -> None:
    raise PoisonError("the library gave up")


@tasks.handler("poison.kill")
def poison_kill(payload: None) -> None:
    """Kills its own process, as a segfault in a C extension or os._exit() does: nothing in
    the worker runs after it (no error line, no settle, no release)."""
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


@tasks.handler("block_forever", timeout=1)
def block_forever(payload: None) -> None:
    """A sync handler that never returns (a socket with no timeout, a deadlock)."""
    import time

    time.sleep(3600)


@tasks.handler("quick")
def quick(payload: None, ctx: TaskContext) -> None:
    _record(ctx)


@tasks.handler("leak")
def leak(payload: None) -> None:
    """Quotes the database's password in its error, as a careless handler does."""
    password = psycopg.conninfo.conninfo_to_dict(os.environ["OUTBOXKIT_DSN"]).get("password")
    raise RuntimeError(f"login failed, password was {password}")


@tasks.handler("effect")
def effect(payload: dict[str, int], ctx: TaskContext) -> None:
    """A healthy task whose effect commits with its fenced completion (ctx.transaction())."""
    import time

    time.sleep(payload.get("ms", 20) / 1000)
    with ctx.transaction() as conn:
        conn.execute("INSERT INTO effects VALUES (%s, %s)", (ctx.id, ctx.attempt))


FANIN_DDL = (
    "CREATE TABLE IF NOT EXISTS fanin_runs (task_id bigint, attempt int, kind text,"
    " at timestamptz DEFAULT clock_timestamp(), seen int)"
)


@tasks.handler("fanin.child", keep_result=True)
async def fanin_child(payload: dict[str, int], ctx: TaskContext) -> dict[str, int]:
    """A child of a fan-in: works a little, returns its number (kept for the callback)."""
    await asyncio.sleep(payload.get("sleep_ms", 20) / 1000)
    return {"n": payload["n"], "square": payload["n"] ** 2}


@tasks.handler("fanin.callback", keep_result=True)
def fanin_callback(payload: None, ctx: TaskContext) -> int:
    """The fan-in's callback: reads its children's results and records the run with how
    many it saw done, in its own fenced transaction (a zombie's run never lands)."""
    children = ctx.dependencies()
    done = [c for c in children if c.status == "done" and c.value is not None]
    with ctx.transaction() as conn:
        conn.execute(
            "INSERT INTO fanin_runs (task_id, attempt, kind, seen) VALUES (%s, %s, 'callback', %s)",
            (ctx.id, ctx.attempt, len(done)),
        )
    return sum(c.value["n"] for c in done)


@tasks.handler("zombie.result", keep_result=True)
def zombie_result(payload: None, ctx: TaskContext) -> dict[str, int]:
    """Reports progress and returns its attempt; the first attempt dawdles (the test freezes
    its worker with SIGSTOP past the lease, and thaws it while another attempt runs)."""
    import time

    _record(ctx)
    ctx.progress({"attempt": ctx.attempt})
    time.sleep(3 if ctx.attempt == 1 else 1.5)
    ctx.progress({"attempt": ctx.attempt, "final": 1})
    return {"attempt": ctx.attempt}


LIMITED_DDL = (
    "CREATE TABLE IF NOT EXISTS limited_runs (id bigserial PRIMARY KEY, task_id bigint,"
    " attempt int, pid int, started timestamptz DEFAULT clock_timestamp(), ended timestamptz,"
    " claimed timestamptz)"
)


@tasks.handler("limited", concurrency=4)
async def limited(payload: dict[str, float], ctx: TaskContext) -> None:
    """At most 4 at once across every worker: records its start and end by the database's
    clock (the test counts the overlap), sleeping between them."""
    dsn = os.environ["OUTBOXKIT_DSN"]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "INSERT INTO limited_runs (task_id, attempt, pid) VALUES (%s, %s, %s) RETURNING id",
            (ctx.id, ctx.attempt, os.getpid()),
        )
        row = await cur.fetchone()
        assert row is not None
        await asyncio.sleep(payload["seconds"])
        await conn.execute(
            "UPDATE limited_runs SET ended = clock_timestamp() WHERE id = %s", (row[0],)
        )


@tasks.handler("paced", rate="50/s")
async def paced(payload: None, ctx: TaskContext) -> None:
    """At most 50 starts a second across every worker (+ the burst of 5): records its start
    by the database's clock, and the claim's time that started it (the task row's
    ``started_at``, the time the bucket was spent at)."""
    async with await psycopg.AsyncConnection.connect(
        os.environ["OUTBOXKIT_DSN"], autocommit=True
    ) as conn:
        await conn.execute(
            "INSERT INTO limited_runs (task_id, attempt, pid, claimed)"
            f" SELECT %s, %s, %s, started_at FROM {tasks.table} WHERE id = %s",
            (ctx.id, ctx.attempt, os.getpid(), ctx.id),
        )


KEYED_DDL = (
    "CREATE TABLE IF NOT EXISTS keyed_runs (id bigserial PRIMARY KEY, task_id bigint, key text,"
    " pid int, started timestamptz DEFAULT clock_timestamp(), ended timestamptz)"
)


async def _run_keyed(ctx: TaskContext, key: str, seconds: float) -> None:
    """Records the run's start and end by the database's clock (the test counts the overlap
    per key), sleeping between them."""
    dsn = os.environ["OUTBOXKIT_DSN"]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "INSERT INTO keyed_runs (task_id, key, pid) VALUES (%s, %s, %s) RETURNING id",
            (ctx.id, key, os.getpid()),
        )
        row = await cur.fetchone()
        assert row is not None
        await asyncio.sleep(seconds)
        await conn.execute(
            "UPDATE keyed_runs SET ended = clock_timestamp() WHERE id = %s", (row[0],)
        )


@tasks.handler("per_key", concurrency_per_key=2)
async def per_key(payload: dict[str, float], ctx: TaskContext) -> None:
    """At most 2 of one key at once across every worker (the claim in the database)."""
    assert ctx.key is not None
    await _run_keyed(ctx, ctx.key, payload["seconds"])


_KEY_SLOTS: dict[str, asyncio.Semaphore] = {}


@tasks.handler("naive_per_key")
async def naive_per_key(payload: dict[str, Any], ctx: TaskContext) -> None:
    """The naive per-key limit: a semaphore of 2 per key in each worker process (the tasks
    are enqueued without a key; the payload names it)."""
    key = str(payload["key"])
    async with _KEY_SLOTS.setdefault(key, asyncio.Semaphore(2)):
        await _run_keyed(ctx, key, float(payload["seconds"]))


@tasks.handler("key_paced", rate_per_key="10/s", concurrency_per_key=5)
async def key_paced(payload: None, ctx: TaskContext) -> None:
    """At most 10 starts a second of each key across every worker (+ the burst of 1)."""
    assert ctx.key is not None
    await _run_keyed(ctx, ctx.key, 0.0)


WAITS_DDL = (
    "CREATE TABLE IF NOT EXISTS light_waits (task_id bigint, task_name text,"
    " wait float8, at timestamptz DEFAULT clock_timestamp())"
)


async def _run_flood_or_light(payload: dict[str, Any], ctx: TaskContext) -> None:
    """A flood's task sleeps ``seconds``; a light key's (``at``: the database's clock just
    before its enqueue's commit) records its wait, from that commit to this start."""
    if payload.get("at") is None:
        await asyncio.sleep(float(payload["seconds"]))
        return
    dsn = os.environ["OUTBOXKIT_DSN"]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO light_waits (task_id, task_name, wait) VALUES"
            " (%s, %s, extract(epoch FROM clock_timestamp())::float8 - %s)",
            (ctx.id, ctx.name, float(payload["at"])),
        )


@tasks.handler("fair", fair=True)
async def fair(payload: dict[str, Any], ctx: TaskContext) -> None:
    """Each key served in turn: a flooding key holds another back by about one claim."""
    await _run_flood_or_light(payload, ctx)


@tasks.handler("unfair")
async def unfair(payload: dict[str, Any], ctx: TaskContext) -> None:
    """The same without fair= (the flood enqueued without a key: a queue in id order)."""
    await _run_flood_or_light(payload, ctx)
