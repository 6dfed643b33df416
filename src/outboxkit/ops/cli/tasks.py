"""``outboxkit tasks list | failed | show | replay | cancel | discard | purge | queues | pause |
resume``: the task table and its queues."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import click
from rich.table import Table

from outboxkit._redact import redact, remember_secrets
from outboxkit.backends.ports import TaskAdmin
from outboxkit.ops.cli.guard import run_guarded
from outboxkit.ops.cli.options import (
    dsn_option,
    json_option,
    older_than_option,
    parse_duration,
    tasks_table_option,
)
from outboxkit.ops.cli.output import console, fail, jsonable, ok

_STATES = ("pending", "waiting", "running", "done", "failed", "cancelled")

tasks_table = tasks_table_option()


def task_dsn_option(command: Callable[..., None]) -> Callable[..., None]:
    """--dsn, and a database without task mode refused at once in one line."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        from outboxkit.tasks.unsupported import missing

        reason = missing(kwargs.get("dsn") or "")
        if reason is not None:
            fail(reason, 2)
        remember_secrets(kwargs.get("dsn") or "")  # a handler's error may quote them
        command(*args, **kwargs)

    return dsn_option(run)


json_lines = json_option("JSON lines, for programs.")
task_name = click.option("--name", default=None, help="Only tasks of this name.")
task_limit = click.option(
    "--limit",
    type=click.IntRange(1, 100_000),
    default=100,
    show_default=True,
    help="At most this many tasks.",
)


def _ops(dsn: str) -> TaskAdmin:
    """The task table's functions of ``dsn``'s database (its backend's)."""
    from outboxkit.backends import backend_for

    return backend_for(dsn).task_admin()


@click.group()
def tasks() -> None:
    """Look at task mode's table and act on its tasks (see `outboxkit worker`)."""


def _print(rows: list[dict[str, Any]], as_json: bool, title: str) -> None:
    from outboxkit.queue.tasks import TaskStatus

    for row in rows:
        for column in ("last_error", "traceback_excerpt"):
            if row.get(column):
                row[column] = redact(str(row[column]))
    if as_json:
        for row in rows:
            row = {**row, "status": TaskStatus(row["status"]).name.lower()}
            click.echo(json.dumps({k: jsonable(v) for k, v in row.items()}))
        return
    if not rows:
        ok(f"no {title}")
        return
    table = Table(title=title)
    for column in ("id", "task", "queue", "status", "attempts", "run at", "error"):
        table.add_column(column)
    for r in rows:
        error = r["last_error"] or ""
        kind = r["error_type"]
        if kind and not error.startswith(f"{kind}:"):  # (a handler's error names its type)
            error = f"{kind}: {error}"
        table.add_row(
            str(r["id"]),
            r["task_name"],
            r["queue"],
            TaskStatus(r["status"]).name.lower(),
            str(r["attempts"]),
            r["available_at"].isoformat(timespec="seconds"),
            error[:120],
        )
    console.print(table)


@tasks.command("list")
@task_dsn_option
@tasks_table
@click.option("--status", type=click.Choice(_STATES), default=None, help="Only this state.")
@task_name
@click.option("--queue", default=None, help="Only tasks of this queue.")
@task_limit
@json_lines
def list_command(
    dsn: str,
    tasks_table: str,
    status: str | None,
    name: str | None,
    queue: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Tasks, oldest first."""
    from outboxkit.queue.tasks import TaskStatus

    state = None if status is None else TaskStatus[status.upper()]
    rows = run_guarded(
        _ops(dsn).list_tasks, dsn, tasks_table, status=state, name=name, queue=queue, limit=limit
    )
    _print(rows, as_json, "tasks")
    if not as_json:
        _say_paused(dsn, tasks_table, queue)


def _say_paused(dsn: str, tasks_table: str, only: str | None) -> None:
    """One line per paused queue under a person's listing (no worker claims from it)."""

    for q in run_guarded(_ops(dsn).queue_states, dsn, tasks_table):
        if q["paused"] and only in (None, q["queue"]):
            console.print(
                f"[yellow]queue {q['queue']} is paused[/] since"
                f" {q['changed_at'].isoformat(timespec='seconds')}"
                f"{' by ' + q['changed_by'] if q['changed_by'] else ''}: its tasks wait"
                f" (`outboxkit tasks resume {q['queue']}`)",
                markup=True,
                highlight=False,
            )


def _who() -> str:
    """Who pauses or resumes, as the pause record keeps it (user@host, from the CLI)."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except Exception:  # no user name in a bare container
        user = "?"
    return f"cli {user}@{socket.gethostname()}"


@tasks.command("queues")
@task_dsn_option
@tasks_table
@json_lines
def queues_command(dsn: str, tasks_table: str, as_json: bool) -> None:
    """Each queue: paused or running, its queued and running tasks."""

    rows = run_guarded(_ops(dsn).queue_states, dsn, tasks_table)
    if as_json:
        for row in rows:
            click.echo(json.dumps({k: jsonable(v) for k, v in row.items()}))
        return
    if not rows:
        ok("no queues: no live task, nothing paused")
        return
    table = Table(title="queues")
    for column in ("queue", "state", "queued", "running", "since", "by"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["queue"],
            "[yellow]paused[/]" if r["paused"] else "running",
            str(r["queued"]),
            str(r["running"]),
            r["changed_at"].isoformat(timespec="seconds") if r["changed_at"] else "",
            r["changed_by"] or "",
        )
    console.print(table)


@tasks.command("pause")
@task_dsn_option
@tasks_table
@click.argument("queue")
def pause_command(dsn: str, tasks_table: str, queue: str) -> None:
    """Stop every worker claiming from QUEUE.

    Workers stop at their next claim (running tasks finish); enqueue keeps working and the
    tasks wait. A worker started while the queue is paused does not claim from it either.
    """

    if run_guarded(_ops(dsn).pause_queue, dsn, tasks_table, queue, by=_who()):
        ok(f"paused queue {queue}: no worker claims from it until `outboxkit tasks resume {queue}`")
    else:
        ok(f"queue {queue} was paused already")


@tasks.command("resume")
@task_dsn_option
@tasks_table
@click.argument("queue")
def resume_command(dsn: str, tasks_table: str, queue: str) -> None:
    """Let workers claim from QUEUE again (waiting workers are woken at once)."""

    if run_guarded(_ops(dsn).resume_queue, dsn, tasks_table, queue, by=_who()):
        ok(f"resumed queue {queue}")
    else:
        ok(f"queue {queue} was not paused")


@tasks.command("failed")
@task_dsn_option
@tasks_table
@task_name
@task_limit
@json_lines
def failed_command(dsn: str, tasks_table: str, name: str | None, limit: int, as_json: bool) -> None:
    """Failed tasks (dead letters), with their error; `tasks show ID` for the traceback."""
    from outboxkit.queue.tasks import TaskStatus

    rows = run_guarded(
        _ops(dsn).list_tasks, dsn, tasks_table, status=TaskStatus.FAILED, name=name, limit=limit
    )
    _print(rows, as_json, "failed tasks")


@tasks.command("show")
@task_dsn_option
@tasks_table
@click.argument("task_id", type=int)
@json_lines
def show_command(dsn: str, tasks_table: str, task_id: int, as_json: bool) -> None:
    """Every column of one task: its state, payload, error and traceback excerpt.

    For a person: one field a line and the traceback as its lines; --json for programs.
    """
    from outboxkit.queue.tasks import TaskStatus

    row = run_guarded(_ops(dsn).show_task, dsn, tasks_table, task_id)
    if row is None:
        fail(f"no task {task_id} in {tasks_table!r}")
    row.pop("payload", None)
    row["status"] = TaskStatus(row["status"]).name.lower()
    for column in ("last_error", "traceback_excerpt"):
        if row.get(column):
            row[column] = redact(str(row[column]))
    if as_json:
        click.echo(json.dumps({k: jsonable(v) for k, v in row.items()}, indent=2))
        return
    traceback = row.pop("traceback_excerpt", None)
    payload = row.pop("payload_json", None)
    for name, value in row.items():
        shown = jsonable(value)
        click.echo(f"{name + ':':<18} {'' if shown is None else shown}")
    click.echo(f"{'payload:':<18} {payload}")
    if traceback:
        click.echo("traceback:")
        for line in str(traceback).splitlines():
            click.echo(f"  {line}")


@tasks.command("replay")
@task_dsn_option
@tasks_table
@click.argument("task_ids", type=int, nargs=-1)
@click.option("--all", "all_failed", is_flag=True, help="Every failed or cancelled task.")
@click.option("--name", default=None, help="With --all: only tasks of this name.")
def replay_command(
    dsn: str, tasks_table: str, task_ids: tuple[int, ...], all_failed: bool, name: str | None
) -> None:
    """Run failed or cancelled tasks again, from their first attempt."""

    if not task_ids and not all_failed:
        fail("give task ids, or --all", 2)
    done, skipped = run_guarded(
        _ops(dsn).replay_tasks_reporting,
        dsn,
        tasks_table,
        task_ids,
        all_failed=all_failed,
        name=name,
    )
    ok(f"replayed {len(done)} task(s)")
    for task_id, key in skipped:
        click.echo(
            f"skipped task {task_id}: its unique_key {redact(key)[:80]!r} is held by a live"
            " task (or a newer failed one replayed with it); discard it, or replay it later"
        )


@tasks.command("cancel")
@task_dsn_option
@tasks_table
@click.argument("task_ids", type=int, nargs=-1, required=True)
def cancel_command(dsn: str, tasks_table: str, task_ids: tuple[int, ...]) -> None:
    """Cancel pending or running tasks (a running one's completion then changes nothing)."""

    done = run_guarded(_ops(dsn).cancel_tasks, dsn, tasks_table, task_ids)
    ok(f"cancelled {len(done)} task(s)")


@tasks.command("discard")
@task_dsn_option
@tasks_table
@click.argument("task_ids", type=int, nargs=-1, required=True)
def discard_command(dsn: str, tasks_table: str, task_ids: tuple[int, ...]) -> None:
    """Delete failed or cancelled tasks for good."""

    done = run_guarded(_ops(dsn).discard_tasks, dsn, tasks_table, task_ids)
    ok(f"discarded {len(done)} task(s)")


@tasks.command("purge")
@task_dsn_option
@tasks_table
@older_than_option("Finished at least this long ago: 30d, 12h, 90m.")
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Tasks deleted per transaction.",
)
def purge_command(dsn: str, tasks_table: str, older_than: str, batch_size: int) -> None:
    """Delete done and cancelled tasks (worker --retention keep) in small batches."""

    age = parse_duration(older_than).total_seconds()
    count = run_guarded(
        _ops(dsn).purge_finished, dsn, tasks_table, older_than=age, batch_size=batch_size
    )
    ok(f"purged {count} finished task(s)")
