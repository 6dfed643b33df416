"""``outboxkit worker``: run the task handlers an application registered (task mode)."""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import click

from outboxkit._redact import redact
from outboxkit.errors import OutboxkitError
from outboxkit.ops.cli.options import (
    dsn_or_file_options,
    given,
    log_format_option,
    metrics_options,
    one_of_dsn_or_file,
    pooler_options,
    reload_interval_option,
)
from outboxkit.ops.cli.output import fail
from outboxkit.ops.logs import setup_logging
from outboxkit.queue.tasks import DEFAULT_MAX_TASK_NAMES


def load_app(spec: str) -> Any:
    """The ``Tasks`` object named by ``module:attribute`` (the module imported from sys.path)."""
    from outboxkit.tasks import Tasks

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        fail(f"--app takes module:attribute (e.g. myapp.jobs:tasks), got {spec!r}", 2)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        fail(f"--app {spec}: cannot import {module_name!r} ({exc})", 2)
    app = getattr(module, attribute, None)
    if not isinstance(app, Tasks):
        fail(f"--app {spec}: {module_name}.{attribute} is not an outboxkit.tasks.Tasks", 2)
    return app


def _run_on(loop_name: str, main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on the chosen event loop (uvloop: its own C loop, as ``pgq run`` uses)."""
    if loop_name != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop_name == "uvloop":
                main.close()
                fail("--loop uvloop: uvloop is not installed (`pip install uvloop`)", 2)
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def _freeze_start_up_heap() -> None:
    """Start-up's objects (click, every imported module) out of the collector's sight, as
    `outboxkit relay` does: each full collection would walk them while tasks allocate."""
    gc.collect()
    gc.freeze()


@click.command()
@dsn_or_file_options(
    "Work on every database listed in this file, one process for all (the file of"
    " `relay --dsn-file`: a line is DSN or NAME DSN); each gets its own worker. Read again"
    " on SIGHUP and every --reload-interval."
)
@reload_interval_option("worker")
@click.option("--app", "app_spec", required=True, help="The Tasks object: module:attribute.")
@click.option(
    "--concurrency",
    type=click.IntRange(min=1, max=10_000),
    default=None,
    help="Tasks running at once in this worker [default: 10].",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1, max=10_000),
    default=None,
    help="Tasks per claim, run at once and settled together [default: 1: each task runs"
    " and settles on its own, claims batched by --prefetch, settles grouped as tasks finish;"
    " the default is as fast for short tasks].",
)
@click.option(
    "--prefetch",
    type=click.IntRange(min=0, max=10_000),
    default=None,
    help="Tasks a claim may take beyond the free slots, waiting their turn here (never more"
    " than would wait over a quarter of --lease); 0: claim only for free slots"
    " [default: 20 per --concurrency slot, at most 500].",
)
@click.option(
    "--queue",
    "queues",
    multiple=True,
    help="A queue to take tasks from (repeat for several) [default: default]; name=N runs"
    " at most N of its tasks at once (the other queues share the rest of --concurrency).",
)
@click.option(
    "--lease",
    type=click.FloatRange(min=0.1, max=86400),
    default=None,
    help="Seconds a claim holds a task; the heartbeat renews it while the handler runs"
    " [default: 30].",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0, max=86400),
    default=None,
    help="On SIGTERM, seconds running handlers may finish before their tasks are handed"
    " back [default: 30].",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0.01, max=3600),
    default=None,
    help="Seconds between polls when no wake-up arrives [default: 1].",
)
@click.option(
    "--retention",
    type=click.Choice(["delete", "keep"]),
    default=None,
    help="Finished tasks: deleted, or kept as done [default: delete].",
)
@metrics_options("Prometheus /metrics and /healthz")
@click.option(
    "--metrics-max-names",
    type=click.IntRange(0, 100_000),
    default=None,
    help="Task names with series of their own (the busiest); the rest are labelled (other)"
    f" [default: {DEFAULT_MAX_TASK_NAMES}].",
)
@pooler_options(
    "worker",
    session_needs="LISTEN and the wake-up gate's lock",
    through_dsn="claims, settles and handlers' transactions",
)
@click.option(
    "--loop",
    "loop_name",
    type=click.Choice(["auto", "asyncio", "uvloop"]),
    default="auto",
    show_default=True,
    envvar="OUTBOXKIT_LOOP",
    show_envvar=True,
    help="The event loop: auto takes uvloop when it is installed (`pip install uvloop`:"
    " less CPU per task), else asyncio's.",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
    help="Log level.",
)
@log_format_option("text for people, json for log collectors.")
def worker(
    dsn: str | None,
    dsn_file: str | None,
    reload_interval: float | None,
    fleet_lease: float | None,
    app_spec: str,
    concurrency: int | None,
    batch_size: int | None,
    prefetch: int | None,
    queues: tuple[str, ...],
    lease: float | None,
    shutdown_timeout: float | None,
    poll_interval: float | None,
    retention: str | None,
    metrics_port: int | None,
    metrics_host: str,
    metrics_max_names: int | None,
    pooler: str | None,
    direct_dsn: str | None,
    loop_name: str,
    log_level: str,
    log_format: str,
) -> None:
    """Run task handlers straight from the task table (`outboxkit migrate --tasks` first).

    SIGTERM/SIGINT: stop taking tasks, let running handlers finish within
    --shutdown-timeout, hand the rest back. With --dsn-file, one process works on every
    database the file lists, a worker each.

    \b
    Example:
      outboxkit worker --dsn postgresql://app@db/shop --app shop.jobs:tasks --concurrency 20
    """
    from outboxkit.tasks import Worker
    from outboxkit.tasks.unsupported import missing

    one_of_dsn_or_file(dsn, dsn_file)
    reason = None if dsn is None else missing(dsn)  # before importing the app: one line
    if reason is not None:
        fail(reason, 2)
    setup_logging(log_level, log_format)
    app = load_app(app_spec)
    options = given(
        concurrency=concurrency,
        batch_size=batch_size,
        prefetch=prefetch,
        lease=lease,
        shutdown_timeout=shutdown_timeout,
        poll_interval=poll_interval,
        retention=retention,
        pooler=pooler,
        direct_dsn=direct_dsn,
    )
    if queues:
        names: list[str] = []
        limits: dict[str, int] = {}
        for spec in queues:
            name, sep, count = spec.partition("=")
            names.append(name)
            if sep:
                if not count.isdigit() or int(count) < 1:
                    raise click.BadParameter(
                        f"{spec!r}: give a queue as name or name=N, N a whole number >= 1",
                        param_hint="--queue",
                    )
                limits[name] = int(count)
        options["queues"] = names
        if limits:
            options["queue_limits"] = limits
    if dsn_file is not None:
        if direct_dsn is not None:
            fail("--direct-dsn cannot be used with --dsn-file (it names one database)", 2)
        fleet_options = given(reload_interval=reload_interval, lease=fleet_lease)
        served = _Served(metrics_host, metrics_port, metrics_max_names)
        _worker_fleet(app, dsn_file, options, fleet_options, loop_name, served)
        return
    assert dsn is not None
    metrics = None
    if metrics_port is not None:
        from outboxkit.ops.task_metrics import TaskMetrics

        limit = {} if metrics_max_names is None else {"max_names": metrics_max_names}
        metrics = options["observer"] = TaskMetrics(dsn, app.table, **limit)
    try:
        engine = Worker(app, dsn, **options)
    except (OutboxkitError, ValueError) as exc:
        fail(str(exc), 2)

    async def _main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, engine.stop)
        logging.getLogger("outboxkit.cli").info("worker on %s", redact(dsn))
        if metrics is None or metrics_port is None:
            await engine.run()
            return
        from outboxkit.ops.http import serving
        from outboxkit.ops.task_metrics import task_metrics_app

        app = task_metrics_app(metrics, engine.not_ready_reason)
        async with serving(app, metrics_host, metrics_port, what="/metrics /healthz /readyz"):
            await engine.run()

    _freeze_start_up_heap()
    try:
        _run_on(loop_name, _main())
    except OutboxkitError as exc:
        fail(str(exc), 2)
    _exit_past_running_threads(engine)


def _exit_past_running_threads(*engines: Any) -> None:
    """Exit now if a sync handler still runs (past its timeout or the grace period: its
    task was handed back): do not wait for the thread. Idle pool threads do not count."""
    if any(engine.threads_running() for engine in engines):
        logging.getLogger("outboxkit.worker").warning(
            "exiting with a sync handler still running: its task was handed back"
        )
        logging.shutdown()
        os._exit(0)


@dataclass(frozen=True)
class _Served:
    """Where a worker fleet serves /metrics, /healthz and /readyz (port None: nowhere)."""

    host: str
    port: int | None
    max_names: int | None


def _worker_fleet(
    app: Any,
    dsn_file: str,
    options: dict[str, Any],
    fleet_options: dict[str, Any],
    loop_name: str,
    served: _Served,
) -> None:
    """``--dsn-file``: a Worker per database of the file (outboxkit.fleet), one process;
    with a metrics port, each worker's metrics labelled with its database."""
    import weakref

    from outboxkit.errors import ConfigurationError
    from outboxkit.fleet.dsn_file import Database
    from outboxkit.fleet.supervisor import WORKER_WORDS, Fleet, Member
    from outboxkit.ops.cli.fleet import serve_fleet, tag_log_lines
    from outboxkit.ops.fleet_metrics import WorkerFleetMetrics
    from outboxkit.ops.http import raise_open_file_limit
    from outboxkit.ops.task_metrics import TaskMetrics
    from outboxkit.tasks import Worker
    from outboxkit.tasks.unsupported import missing

    tag_log_lines()
    workers: weakref.WeakSet[Worker] = weakref.WeakSet()
    fleet_metrics = WorkerFleetMetrics() if served.port is not None else None
    limit = {} if served.max_names is None else {"max_names": served.max_names}
    metrics_of: dict[object, TaskMetrics] = {}  # by its Worker

    def make(database: Database) -> Worker:
        reason = missing(database.dsn)
        if reason is not None:
            raise ConfigurationError(reason)
        metrics = None
        if fleet_metrics is not None:
            metrics = TaskMetrics(database.dsn, app.table, **limit)
        try:
            engine = Worker(app, database.dsn, **options, observer=metrics)
        except ValueError as exc:  # (an option out of range: said per database, once)
            raise ConfigurationError(str(exc)) from None
        workers.add(engine)
        if fleet_metrics is not None and metrics is not None:
            metrics.attach(engine)
            metrics_of[engine] = metrics
            fleet_metrics.add(database.name, metrics)
        return engine

    def removed(member: Member) -> None:
        metrics = metrics_of.pop(member.service, None)
        if fleet_metrics is not None and metrics is not None:
            fleet_metrics.remove(member.database.name, metrics)

    service = f"worker:{app.table}"
    fleet = Fleet(
        dsn_file, make, words=WORKER_WORDS, service=service, on_removed=removed, **fleet_options
    )
    if fleet_metrics is not None:
        raise_open_file_limit()
    describe = f"worker fleet: the databases of {dsn_file}"
    _freeze_start_up_heap()
    try:
        _run_on(loop_name, serve_fleet(fleet, describe, fleet_metrics, served.host, served.port))
    except OutboxkitError as exc:
        fail(str(exc), 2)
    _exit_past_running_threads(*workers)
