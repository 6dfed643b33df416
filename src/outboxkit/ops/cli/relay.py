"""``outboxkit relay``: publish the outbox to a broker, with metrics and the dashboard."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Any

import click

from outboxkit._redact import redact
from outboxkit.errors import OutboxkitError
from outboxkit.ops.cli.options import (
    MAX_INT4,
    METRICS,
    RELAY,
    LibraryOption,
    admin_token_option,
    allow_host_option,
    batch_shape_help,
    count_range,
    dsn_or_file_options,
    given,
    in_range,
    log_format_option,
    metrics_options,
    one_of_dsn_or_file,
    pooler_options,
    reload_interval_option,
    seconds_range,
    table_option,
)
from outboxkit.ops.cli.output import fail
from outboxkit.ops.logs import setup_logging


@click.command()
@dsn_or_file_options(
    "Relay every database listed in this file, one process for all: a line is DSN or"
    " NAME DSN, # starts a comment; passwords may come from PGPASSWORD or a passfile"
    " instead. Read again on SIGHUP and every --reload-interval: databases added start,"
    " removed ones stop (the fleet guide, linked below)."
)
@reload_interval_option("relay")
@click.option(
    "--broker",
    envvar="OUTBOXKIT_BROKER",
    required=True,
    show_envvar=True,
    help="Broker URL: kafka://, nats://, amqp[s]://, redis[s]://, sqs://QUEUE, an http[s]://"
    " webhook, or celery+amqp:// / celery+redis:// (tasks written by"
    " outboxkit.contrib.celery.send_task); the options of each are linked below.",
)
@click.option(
    "--route",
    "routes",
    multiple=True,
    metavar="[type:|aggregate:|topic:]GLOB=DEST",
    help="Publish events whose event_type (or aggregate_type, or topic) matches GLOB to DEST"
    " instead of their topic; repeatable, first match wins. E.g. --route 'order.*=orders'.",
)
@table_option
@click.option(
    "--source",
    type=click.Choice(["poll", "cdc"]),
    default=None,
    help="poll: claim rows from the table [default]. cdc: stream the outbox's logical"
    " replication slot in commit order (run `outboxkit cdc setup` first; a second relay on"
    " the slot waits as a standby and takes over). See README, 'Relaying from the WAL'.",
)
@click.option(
    "--slot",
    default=None,
    help="With --source cdc: the replication slot to stream [default: outboxkit_<table>].",
)
@click.option(
    "--batch-size",
    callback=count_range,
    cls=LibraryOption,
    default_from=batch_shape_help(0),
    type=click.IntRange(min=1),
    help="Events claimed per batch.",
)
@click.option(
    "--max-in-flight",
    callback=count_range,
    cls=LibraryOption,
    default_from=batch_shape_help(1),
    type=click.IntRange(min=1),
    help="Batches claimed but not yet settled at once, so the next claim overlaps the publish.",
)
@click.option(
    "--synchronous-commit",
    cls=LibraryOption,
    default_from=(RELAY, "synchronous_commit"),
    is_flag=True,
    default=None,
    help="Make the relay's own claims and settles wait for the WAL flush. Without it, losing"
    " one in a database crash only re-publishes events, never loses them.",
)
@click.option(
    "--poll-interval",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=(RELAY, "poll_interval"),
    type=float,
    help="Seconds between polls when idle (NOTIFY usually wakes the relay sooner).",
)
@click.option(
    "--linger",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=(RELAY, "linger"),
    type=click.FloatRange(min=0),
    help="Seconds a relay that found work keeps looking (after 2, 4, 8, ... ms) before it"
    " waits for a NOTIFY. Writers notify only while a relay waits, so a busy relay spares"
    " them NOTIFY's commit-time lock; 0 waits at once (lowest CPU when idle).",
)
@click.option(
    "--lease",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=(RELAY, "lease"),
    type=float,
    help="Seconds a claim is held; a crashed relay's rows are re-claimed after it.",
)
@click.option(
    "--publish-timeout",
    callback=seconds_range,
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds one batch's publish may take before it is retried [default: 0.8 x --lease]."
    " It may exceed --lease: a publish still running extends its rows' lease every lease/3"
    " (a slow webhook is not cut at the lease); a relay that dies stops extending.",
)
@click.option(
    "--max-attempts",
    callback=count_range,
    cls=LibraryOption,
    default_from=(RELAY, "max_attempts"),
    type=int,
    help="Publish attempts before an event is dead-lettered (status failed).",
)
@click.option(
    "--retention",
    cls=LibraryOption,
    default_from=(RELAY, "retention"),
    type=click.Choice(["delete", "keep"]),
    help="delete published rows (no bloat) or keep them as an audit trail (then purge).",
)
@click.option(
    "--relay-id",
    help="Name shown in claimed_by [default: host-pid-random]. Ordered relays refuse to run"
    " two processes with one id on a table (they would share its partitions).",
)
@click.option(
    "--retry-base",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=(RELAY, "retry_base"),
    type=float,
    help="First retry delay cap (s).",
)
@click.option(
    "--retry-cap",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=(RELAY, "retry_cap"),
    type=float,
    help="Longest retry delay (s).",
)
@click.option(
    "--no-listen",
    "listen",
    flag_value=False,
    default=None,
    help="Do not LISTEN for NOTIFY; poll only.",
)
@pooler_options(
    "relay",
    session_needs="LISTEN, the wake-up gate's lock, ordered mode's relay-id lock",
    through_dsn="claims and settles",
)
@click.option(
    "--shutdown-timeout",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=(RELAY, "shutdown_timeout"),
    type=float,
    help="Seconds to let in-flight batches finish on SIGTERM before handing their rows back.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="info: start-up, the first batch, periodic summaries and every failure;"
    " debug adds a line per failed event.",
)
@log_format_option("json: one object per line (ts, level, logger, msg, fields) for log pipelines.")
@click.option(
    "--log-interval",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=("outboxkit.sink.observer:SummaryLog", "interval"),
    type=float,
    help="Seconds between INFO summaries of claims and publishes (failures are logged at once).",
)
@metrics_options(
    "/metrics (Prometheus), /healthz and /readyz",
    port_envvar=True,
    host_note="(see the operations guide linked below: with --dashboard that shows payloads"
    " to whoever reaches it)",
)
@click.option(
    "--metrics-max-topics",
    callback=in_range(0, MAX_INT4),
    cls=LibraryOption,
    default_from=(METRICS, "max_topics"),
    type=int,
    help="Topics with series of their own (the busiest); the rest are labelled (other).",
)
@click.option(
    "--metrics-topic",
    "metrics_topics",
    multiple=True,
    help="Label exactly these topics (repeat it), the rest as (other) [default: the busiest].",
)
@click.option(
    "--dashboard",
    "with_dashboard",
    is_flag=True,
    help="Also serve the web dashboard at /dashboard/ on --metrics-port (see `dashboard`).",
)
@allow_host_option(
    "With --dashboard: a Host name it answers to besides IP addresses and localhost"
    " (repeat it; names not listed are refused against DNS rebinding)."
)
@admin_token_option(
    "With --dashboard: enables replay/discard for whoever enters it [default: read-only]."
)
@click.option(
    "--gauge-interval",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=(METRICS, "gauge_interval"),
    type=float,
    help="Seconds between reads of the table gauges (backlog, failed, oldest pending age).",
)
@click.option(
    "--ordered",
    is_flag=True,
    default=None,
    help="Publish each key's events in commit order, also across several relays, crashes and"
    " retries (needs `migrate --ordered` and Outbox(ordered=True) writers). Relays divide the"
    " table's partitions; a failing event holds back only the later events of its key.",
)
@click.option(
    "--on-dead-letter",
    "dead_letter_policy",
    cls=LibraryOption,
    default_from=(RELAY, "dead_letter_policy"),
    type=click.Choice(["block", "skip"]),
    help="With --ordered, when a key's head event is dead-lettered: block stops the key until"
    " `outboxkit replay` (or discard) of that event, safe for state changes; skip publishes"
    " the key's later events without it.",
)
def relay(
    dsn: str | None,
    dsn_file: str | None,
    reload_interval: float | None,
    fleet_lease: float | None,
    broker: str,
    routes: tuple[str, ...],
    table: str,
    log_level: str,
    log_format: str,
    log_interval: float | None,
    metrics_port: int | None,
    metrics_host: str,
    metrics_max_topics: int | None,
    metrics_topics: tuple[str, ...],
    with_dashboard: bool,
    allow_hosts: tuple[str, ...],
    admin_token: str | None,
    gauge_interval: float | None,
    **relay_options: Any,
) -> None:
    """Publish events from the outbox to a broker until stopped (SIGTERM/SIGINT).

    Run as many relays as you like on one table: claims never overlap. On
    SIGTERM a relay stops claiming, finishes its in-flight batch, hands back
    unpublished rows and exits 0.

    With --dsn-file, one process relays every database the file lists, each with its own
    claim loop, leases and metrics (labelled with the database's name).

    \b
    Example:
      OUTBOXKIT_DSN=postgresql://app:secret@db/shop \\
        outboxkit relay --broker kafka://kafka-1:9092,kafka-2:9092

    \b
    Broker URLs and their options, the operations guide and the fleet's (--dsn-file):
      https://github.com/outboxkit/outboxkit/blob/main/docs/brokers.md
      https://github.com/outboxkit/outboxkit/blob/main/docs/operations.md
      https://github.com/outboxkit/outboxkit/blob/main/docs/fleet.md
    """
    from outboxkit.publishers import from_url
    from outboxkit.relay import Relay

    setup_logging(log_level, log_format)
    if with_dashboard and metrics_port is None:
        fail("--dashboard is served on the metrics port: give --metrics-port too", 2)
    one_of_dsn_or_file(dsn, dsn_file)
    summary = given(interval=log_interval)
    metrics_settings = given(
        gauge_interval=gauge_interval,
        max_topics=metrics_max_topics,
        topics=metrics_topics or None,
    )
    if dsn_file is not None:
        _relay_fleet(
            dsn_file,
            broker,
            routes,
            table,
            given(reload_interval=reload_interval, lease=fleet_lease),
            metrics_port,
            metrics_host,
            with_dashboard,
            summary=summary,
            metrics=metrics_settings,
            relay_options=given(**relay_options),
        )
        return
    assert dsn is not None
    try:
        from outboxkit.publishers.routing import with_routes

        publisher = with_routes(from_url(broker), routes)
        observer, metrics = _relay_observer(
            dsn,
            table,
            broker,
            metrics_port,
            summary=summary,
            metrics=metrics_settings,
        )
        board_state = None
        if with_dashboard:
            from outboxkit.ops.dashboard import Dashboard

            board_state = Dashboard(
                dsn,
                table=table,
                admin_token=admin_token,
                host=metrics_host,
                allowed_hosts=allow_hosts,
            )
        # Only what the user gave: every other option is Relay's own default.
        engine = Relay(dsn, publisher, table=table, observer=observer, **given(**relay_options))
    except OutboxkitError as exc:
        fail(str(exc), 2)

    async def _main() -> None:
        from outboxkit.ops.http import metrics_app, raise_open_file_limit, serving

        raise_open_file_limit()  # HTTP clients must not take the sockets the relay needs
        _freeze_start_up_heap()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, engine.stop)
        logging.getLogger("outboxkit.cli").info("relay from %s to %s", redact(dsn), redact(broker))
        if metrics is None or metrics_port is None:
            await engine.run()
            return
        metrics.attach(engine)
        board = None
        if board_state is not None:
            from outboxkit.ops.dashboard import dashboard_app

            board = dashboard_app(board_state)
        what = "/metrics /healthz /readyz" + (" /dashboard/" if board is not None else "")
        async with serving(
            metrics_app(metrics, dashboard=board), metrics_host, metrics_port, what=what
        ):
            gauges = asyncio.create_task(metrics.run_gauges())
            try:
                await engine.run()
            finally:
                gauges.cancel()
                await asyncio.gather(gauges, return_exceptions=True)

    try:
        asyncio.run(_main())
    except OutboxkitError as exc:
        fail(str(exc), 2)


def _relay_fleet(
    dsn_file: str,
    broker: str,
    routes: tuple[str, ...],
    table: str,
    fleet_options: dict[str, Any],
    metrics_port: int | None,
    metrics_host: str,
    with_dashboard: bool,
    *,
    summary: dict[str, Any],
    metrics: dict[str, Any],
    relay_options: dict[str, Any],
) -> None:
    """``--dsn-file``: one Relay per database of the file (ops/cli/fleet.py, outboxkit.fleet)."""
    from outboxkit.fleet.dsn_file import Database
    from outboxkit.ops.cli.fleet import run_relay_fleet, tag_log_lines
    from outboxkit.publishers import from_url
    from outboxkit.publishers.routing import with_routes
    from outboxkit.relay import Relay

    refused = {
        "--dashboard": with_dashboard,
        "--direct-dsn": relay_options.get("direct_dsn") is not None,
        "--source cdc": relay_options.get("source") == "cdc",
    }
    for option, given_ in refused.items():
        if given_:
            fail(f"{option} serves one database: it cannot be used with --dsn-file", 2)
    try:
        with_routes(from_url(broker), routes)  # a bad broker URL or route fails here, once
    except OutboxkitError as exc:
        fail(str(exc), 2)
    tag_log_lines()

    def make(database: Database) -> tuple[Relay, Any]:
        publisher = with_routes(from_url(broker), routes)  # (one client per database)
        observer, relay_metrics = _relay_observer(
            database.dsn,
            table,
            broker,
            metrics_port,
            summary=summary,
            metrics={**metrics, "process_metrics": False},  # (the fleet's, once)
        )
        relay = Relay(database.dsn, publisher, table=table, observer=observer, **relay_options)
        return relay, relay_metrics

    async def _main() -> None:
        _freeze_start_up_heap()
        await run_relay_fleet(
            dsn_file,
            make,
            broker=broker,
            metrics_host=metrics_host,
            metrics_port=metrics_port,
            service=f"relay:{table}",
            **fleet_options,
        )

    try:
        asyncio.run(_main())
    except OutboxkitError as exc:
        fail(str(exc), 2)


# The collector's first threshold in the relay process: a relay keeps its batches' objects
# (rows, messages, headers; about 13 each per event, 4 000 events in flight) alive until
# they are confirmed, so at CPython's 700 every young collection walks live objects only,
# and each of them again in the older generations. At 50 000, most of them are freed by
# their reference counts before a collection comes: -19 % of the relay process's CPU per
# event (bench/cli_relay.py, docs/benchmarks.md, issue 42 §3); at most 50 000 young objects
# (a few MB) wait for a collection.
_YOUNG_THRESHOLD = 50_000


def _freeze_start_up_heap() -> None:
    """Take the objects of start-up (click, aiohttp, every imported module) out of the
    collector's sight, and collect the young generation less often.

    The CLI process imports far more than a relay embedded in a service needs, and each
    full collection walks all of it while the relay allocates rows and records per
    event: measured (bench/cli_relay.py) as a few µs of CPU per event. Frozen objects
    are never collected, which start-up's are not anyway. The process is the relay's
    alone, so its collector can be tuned for it (`_YOUNG_THRESHOLD`); an embedded
    ``Relay`` leaves the service's collector as it is.
    """
    gc.collect()
    gc.freeze()
    _gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(_YOUNG_THRESHOLD, gen1, gen2)


def _relay_observer(
    dsn: str,
    table: str,
    broker: str,
    metrics_port: int | None,
    *,
    summary: dict[str, Any],
    metrics: dict[str, Any],
) -> tuple[Any, Any]:
    """Summary logs, batch spans (with opentelemetry) and, with --metrics-port, metrics."""
    from urllib.parse import urlsplit

    from outboxkit.sink.observer import BatchTracing, Observers, SummaryLog
    from outboxkit.tracing import available as tracing_available

    observers: list[Any] = [SummaryLog(**summary)]
    if tracing_available():
        observers.append(BatchTracing(system=urlsplit(broker).scheme.lower()))
    relay_metrics = None
    if metrics_port is not None:
        from outboxkit.ops.metrics import RelayMetrics

        relay_metrics = RelayMetrics(dsn, table=table, **metrics)
        observers.append(relay_metrics)
    return Observers(*observers), relay_metrics
