"""``outboxkit dashboard``: the web page on its own, beside the relays."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import click
from rich.text import Text

from outboxkit.errors import ConfigurationError, OutboxkitError
from outboxkit.ops.cli.guard import run_guarded
from outboxkit.ops.cli.options import (
    LibraryOption,
    admin_token_option,
    allow_host_option,
    dsn_option,
    given,
    log_format_option,
    port_range,
    seconds_range,
    table_option,
    tasks_table_option,
)
from outboxkit.ops.cli.output import console, fail
from outboxkit.ops.logs import setup_logging


@click.command()
@dsn_option
@table_option
@tasks_table_option("Task mode's table, shown on the Tasks page (the page says how to create it).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option(
    "--port", callback=port_range, default=8080, show_default=True, help="Port to listen on."
)
@admin_token_option(
    "Enables replay/discard (and cancel, for tasks) for whoever enters this token"
    " [default: read-only]."
)
@click.option(
    "--sample-interval",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=("outboxkit.ops.dashboard:Dashboard", "sample_interval"),
    type=float,
    help="Seconds between table reads.",
)
@allow_host_option(
    "A Host name the page answers to besides IP addresses and localhost (repeat it;"
    " names not listed are refused against DNS rebinding)."
)
@log_format_option("json: one object per line, for log pipelines (actions taken are logged).")
def dashboard(
    dsn: str,
    table: str,
    tasks_table: str,
    host: str,
    port: int,
    admin_token: str | None,
    sample_interval: float | None,
    allow_hosts: tuple[str, ...],
    log_format: str,
) -> None:
    """Serve web pages with live throughput, backlog, topics and dead letters, and tasks.

    The outbox's page is at /, task mode's at /tasks (tasks by state, per task name,
    the oldest queued; a task's payload, error and traceback excerpt).

    Read-only unless started with --admin-token (or OUTBOXKIT_ADMIN_TOKEN): then
    failed events can be replayed or discarded, and tasks replayed, cancelled or
    discarded, by whoever enters the token; every action is logged.

    \b
    Example:
      OUTBOXKIT_ADMIN_TOKEN=$(openssl rand -hex 16) outboxkit dashboard --dsn ... --port 8080
    """
    from outboxkit.ops.dashboard import Dashboard, dashboard_app

    setup_logging("info", log_format)
    run_guarded(_check_tables, dsn, table, tasks_table)  # fail now, readably
    try:
        board = Dashboard(
            dsn,
            table=table,
            tasks_table=tasks_table,
            admin_token=admin_token,
            host=host,
            allowed_hosts=allow_hosts,
            **given(sample_interval=sample_interval),
        )
    except OutboxkitError as exc:
        fail(str(exc), 2)
    mode = "actions enabled (token)" if admin_token else "read-only"
    try:
        asyncio.run(_serve_dashboard(dashboard_app(board), host, port, mode))
    except OutboxkitError as exc:
        fail(str(exc), 2)


def _check_tables(dsn: str, table: str, tasks_table: str) -> None:
    """Refuse a wrong DSN, or a database with neither table. A database used for task mode
    only has no outbox: the dashboard starts, and its outbox page says how to create one."""
    from outboxkit.admin import admin_for
    from outboxkit.backends import backend_for
    from outboxkit.errors import TableNotFoundError
    from outboxkit.tasks.unsupported import missing

    try:
        admin_for(dsn).live_status(dsn, table)
    except TableNotFoundError as no_outbox:
        if missing(dsn):  # no task mode there: the outbox is all it can show
            raise
        try:
            backend_for(dsn).task_admin().task_gauges(dsn, tasks_table)
        except OutboxkitError:
            raise no_outbox from None


async def _serve_dashboard(app: Any, host: str, port: int, mode: str) -> None:
    """Serve until SIGINT/SIGTERM; the URL is announced only once the port is bound."""
    from outboxkit.ops.http import GuardedSite, raise_open_file_limit
    from outboxkit.ops.http import runner as http_runner

    raise_open_file_limit()
    runner = http_runner(app)  # capped connections and header time, as the relay's
    await runner.setup()
    try:
        try:
            await GuardedSite(runner, host, port).start()
        except OSError as exc:
            raise ConfigurationError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port"
            ) from None
        bound = runner.addresses[0][1] if runner.addresses else port  # --port 0: the real one
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{bound}/"
        console.print(Text.assemble("outboxkit dashboard on ", (url, "bold"), f" ({mode})"))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
