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
from outboxkit.fleet.dsn_file import Database, read_dsn_file
from outboxkit.fleet.supervisor import DatabaseTag, Fleet, Member
from outboxkit.ops.cli.output import console, err_console
from outboxkit.ops.metrics import RelayMetrics
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


def fleet_status(path: str, table: str, *, as_json: bool, age: Callable[[Any], str]) -> int:
    """Print each database's backlog and oldest pending age; the exit code (1 when a
    database could not be read or a line was skipped)."""
    listed = read_dsn_file(path)
    with ThreadPoolExecutor(max(1, min(_STATUS_READERS, len(listed.databases)))) as pool:
        readings = list(pool.map(lambda d: _read_status(d, table), listed.databases))
    bad = [{"line": b.line, "error": b.reason} for b in listed.bad_lines]
    if as_json:
        click.echo(json.dumps({"databases": readings, "bad_lines": bad}))
    else:
        _print_table(path, table, readings, age)
        for line in listed.bad_lines:
            err_console.print(
                Text.assemble(("skipped:", "yellow"), f" {path}, {line}"), soft_wrap=True
            )
    return 1 if bad or any(r["error"] for r in readings) else 0


def _read_status(database: Database, table: str) -> dict[str, Any]:
    from outboxkit.admin import admin_for

    shown: dict[str, Any] = {"name": database.name, "line": database.line}
    try:
        report = admin_for(database.dsn).status(database.dsn, table)
        owner = backend_for(database.dsn).fleet_owner(database.dsn, f"relay:{table}")
    except Exception as exc:  # any driver's error: this database is shown as unreachable
        keys = ("pending", "in_flight", "failed", "oldest_pending_age_s", "owner")
        return {**shown, **dict.fromkeys(keys), "error": first_line(exc, with_type=True)}
    return {
        **shown,
        "pending": report.pending,
        "in_flight": report.in_flight,
        "failed": report.failed,
        "oldest_pending_age_s": report.oldest_pending_age_s,
        "owner": owner,
        "error": None,
    }


def _print_table(
    path: str, table: str, readings: list[dict[str, Any]], age: Callable[[Any], str]
) -> None:
    tbl = Table(title=Text(f"{table} in the databases of {path}"), title_justify="left")
    for col in ("database", "line", "pending", "in flight", "failed", "oldest pending", "owner"):
        tbl.add_column(col, justify="left" if col in ("database", "owner") else "right")
    for r in readings:
        if r["error"]:
            tbl.add_row(
                Text(r["name"]),
                str(r["line"]),
                Text(f"unreachable: {r['error']}", style="red"),
                "-",
                "-",
                "-",
                "-",
            )
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
