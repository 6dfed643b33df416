"""``--dsn-file``: ``outboxkit relay`` over every database of a file (outboxkit.fleet), and
``outboxkit status`` of each."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table
from rich.text import Text

from outboxkit._redact import redact
from outboxkit._text import first_line
from outboxkit.backends import backend_for
from outboxkit.errors import SchemaError, TableNotFoundError
from outboxkit.fleet.dsn_file import Database, read_dsn_file
from outboxkit.fleet.supervisor import DatabaseTag, Fleet, Member
from outboxkit.ops.cli.output import console, err_console
from outboxkit.ops.metrics import RelayMetrics
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE
from outboxkit.relay import Relay

if TYPE_CHECKING:
    from outboxkit.ops.fleet_metrics import FleetMetrics

log = logging.getLogger("outboxkit.cli")

#: What the relay command builds for one database: its Relay and, with --metrics-port, its
#: metrics (an observer of that relay).
RelayMaker = Callable[[Database], tuple[Relay, RelayMetrics | None]]
#: Databases whose status is read at once by `status --dsn-file`.
_STATUS_READERS = 16


class MeteredRelay:
    """A database's Relay with its table gauges read while it runs (the fleet's Service)."""

    def __init__(self, relay: Relay, metrics: RelayMetrics | None) -> None:
        self.relay = relay
        self.metrics = metrics
        if metrics is not None:
            metrics.attach(relay)

    def stop(self) -> None:
        self.relay.stop()

    async def run(self) -> None:
        if self.metrics is None:
            await self.relay.run()
            return
        gauges = asyncio.create_task(self.metrics.run_gauges())
        try:
            await self.relay.run()
        finally:
            gauges.cancel()
            await asyncio.gather(gauges, return_exceptions=True)


def tag_log_lines() -> None:
    """Every line a database's relay logs names its database (text: ``[name]``, JSON: a
    ``database`` field)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(DatabaseTag())


async def run_relay_fleet(
    path: str,
    make: RelayMaker,
    *,
    broker: str,
    metrics_host: str,
    metrics_port: int | None,
    **fleet_options: Any,
) -> None:
    """Relay every database of the file at ``path`` until SIGTERM/SIGINT; SIGHUP reloads it.
    ``fleet_options``: :class:`Fleet`'s (``reload_interval``, ``lease``, ``service``)."""
    from outboxkit.ops.fleet_metrics import FleetMetrics
    from outboxkit.ops.http import raise_open_file_limit

    raise_open_file_limit()
    fleet_metrics = FleetMetrics() if metrics_port is not None else None

    def factory(database: Database) -> MeteredRelay:
        relay, metrics = make(database)
        if fleet_metrics is not None and metrics is not None:
            fleet_metrics.add(database.name, metrics)
        return MeteredRelay(relay, metrics)

    def removed(member: Member) -> None:
        service = member.service
        if fleet_metrics is not None and isinstance(service, MeteredRelay) and service.metrics:
            fleet_metrics.remove(member.database.name, service.metrics)

    fleet = Fleet(path, factory, on_removed=removed, **fleet_options)
    describe = f"relay fleet: the databases of {path} to {redact(broker)}"
    await serve_fleet(fleet, describe, fleet_metrics, metrics_host, metrics_port)


async def serve_fleet(
    fleet: Fleet,
    describe: str,
    metrics: FleetMetrics | None,
    metrics_host: str,
    metrics_port: int | None,
) -> None:
    """:func:`run_fleet`, serving ``metrics`` (/metrics /healthz /readyz) meanwhile if given."""
    from outboxkit.ops.http import metrics_app, serving

    if metrics is None or metrics_port is None:
        await run_fleet(fleet, describe)
        return
    metrics.attach(fleet)
    app = metrics_app(metrics, refresh=metrics.refresh)
    try:
        async with serving(app, metrics_host, metrics_port, what="/metrics /healthz /readyz"):
            await run_fleet(fleet, describe)
    finally:
        metrics.close()


async def run_fleet(fleet: Fleet, describe: str) -> None:
    """Run ``fleet`` until SIGTERM/SIGINT (each database's service stops gracefully);
    SIGHUP reads its file again."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, fleet.stop)

    def reload() -> None:
        log.info("SIGHUP: reading %s again", fleet.path)
        fleet.reload()

    loop.add_signal_handler(signal.SIGHUP, reload)
    log.info("%s (read again on SIGHUP and every %gs)", describe, fleet.reload_interval)
    if fleet.lease is not None:
        log.info(
            "fleet member %s: databases divided with the other processes of this file"
            " through a %gs lease in each",
            fleet.member_id,
            fleet.lease,
        )
    await fleet.run()


# -- status --dsn-file -----------------------------------------------------------------


def fleet_status(
    path: str,
    table: str,
    *,
    as_json: bool,
    age: Callable[[Any], str],
    tasks_table: str = DEFAULT_TASKS_TABLE,
) -> int:
    """Print each database's backlog and oldest pending age, and its task table's figures
    where it has one; the exit code (1 when a database could not be read or a line was
    skipped)."""
    listed = read_dsn_file(path)
    with ThreadPoolExecutor(max(1, min(_STATUS_READERS, len(listed.databases)))) as pool:
        readings = list(pool.map(lambda d: _read_status(d, table, tasks_table), listed.databases))
    bad = [{"line": b.line, "error": b.reason} for b in listed.bad_lines]
    if as_json:
        click.echo(json.dumps({"databases": readings, "bad_lines": bad}))
    else:
        if not listed.databases and not listed.bad_lines:
            err_console.print(
                Text.assemble(
                    ("no databases:", "yellow"),
                    f" {path} lists none (a line is a DSN, or a name and a DSN; # comments)",
                ),
                soft_wrap=True,
            )
        if any(r["error"] or r["pending"] is not None for r in readings):
            _print_table(path, table, readings, age)
        if any(r["tasks"] for r in readings):
            _print_tasks(path, tasks_table, readings, age)
        for line in listed.bad_lines:
            err_console.print(
                Text.assemble(("skipped:", "yellow"), f" {path}, {line}"), soft_wrap=True
            )
    return 1 if bad or any(r["error"] for r in readings) else 0


_OUTBOX_KEYS = ("pending", "in_flight", "failed", "oldest_pending_age_s", "owner")


def _read_status(database: Database, table: str, tasks_table: str) -> dict[str, Any]:
    """One database's outbox figures and its task table's (None without one); a database
    with a task table and no outbox table (a worker fleet's) has null outbox figures and
    no error."""
    from outboxkit.admin import admin_for

    shown: dict[str, Any] = {"name": database.name, "line": database.line}
    dsn = database.dsn
    no_outbox: TableNotFoundError | None = None
    try:
        try:
            report = admin_for(dsn).status(dsn, table)
            owner = backend_for(dsn).fleet_owner(dsn, f"relay:{table}")
        except TableNotFoundError as exc:
            no_outbox = exc
        tasks = _read_tasks(dsn, tasks_table)
    except Exception as exc:  # any driver's error: this database is shown as unreachable
        failed = first_line(exc, with_type=True)
        return {**shown, **dict.fromkeys(_OUTBOX_KEYS), "tasks": None, "error": failed}
    if no_outbox is not None:
        error = None if tasks is not None else first_line(no_outbox, with_type=True)
        return {**shown, **dict.fromkeys(_OUTBOX_KEYS), "tasks": tasks, "error": error}
    return {
        **shown,
        "pending": report.pending,
        "in_flight": report.in_flight,
        "failed": report.failed,
        "oldest_pending_age_s": report.oldest_pending_age_s,
        "owner": owner,
        "tasks": tasks,
        "error": None,
    }


def _read_tasks(dsn: str, tasks_table: str) -> dict[str, Any] | None:
    """The task table's queued, scheduled, running and failed counts, oldest queued age and
    the worker fleet process serving it; None when there is no (usable) task table."""
    backend = backend_for(dsn)
    try:
        rows = backend.task_admin().task_gauges(dsn, tasks_table, max_names=0)
    except SchemaError:  # (no task table, or one to migrate: `outboxkit tasks` says which)
        return None
    counts = [sum(int(row[i]) for row in rows) for i in range(1, 5)]
    ages = [float(row[5]) for row in rows if row[5] is not None]
    return {
        **dict(zip(("queued", "scheduled", "running", "failed"), counts, strict=True)),
        "oldest_queued_age_s": max(ages) if ages else None,
        "owner": backend.fleet_owner(dsn, f"worker:{tasks_table}"),
    }


def _print_tasks(
    path: str, tasks_table: str, readings: list[dict[str, Any]], age: Callable[[Any], str]
) -> None:
    tbl = Table(title=Text(f"{tasks_table} in the databases of {path}"), title_justify="left")
    columns = ("database", "queued", "scheduled", "running", "failed", "oldest queued", "owner")
    for col in columns:
        tbl.add_column(col, justify="left" if col in ("database", "owner") else "right")
    for r in readings:
        t = r["tasks"]
        if t is None:
            continue
        tbl.add_row(
            Text(r["name"]),
            str(t["queued"]),
            str(t["scheduled"]),
            str(t["running"]),
            Text(str(t["failed"]), style="red") if t["failed"] else "0",
            age(t["oldest_queued_age_s"]),
            Text(t["owner"] or "-"),
        )
    console.print(tbl)


def _print_table(
    path: str, table: str, readings: list[dict[str, Any]], age: Callable[[Any], str]
) -> None:
    tbl = Table(title=Text(f"{table} in the databases of {path}"), title_justify="left")
    for col in ("database", "line", "pending", "in flight", "failed", "oldest pending", "owner"):
        tbl.add_column(col, justify="left" if col in ("database", "owner") else "right")
    for r in readings:
        if r["error"] or r["pending"] is None:
            said = (
                Text(f"unreachable: {r['error']}", style="red")
                if r["error"]
                else Text("no outbox table (its task table: below)", style="dim")
            )
            tbl.add_row(Text(r["name"]), str(r["line"]), said, "-", "-", "-", "-")
            continue
        tbl.add_row(
            Text(r["name"]),
            str(r["line"]),
            str(r["pending"]),
            str(r["in_flight"]),
            Text(str(r["failed"]), style="red") if r["failed"] else "0",
            age(r["oldest_pending_age_s"]),
            Text(r["owner"] or "-"),
        )
    console.print(tbl)
