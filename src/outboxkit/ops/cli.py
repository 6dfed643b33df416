"""The ``outboxkit`` command: migrate, relay, status, failed, replay, purge, demo."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import inspect
import json
import logging
import re
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from outboxkit._redact import redact
from outboxkit._text import first_line
from outboxkit.errors import ConfigurationError, OutboxkitError, missing_extra
from outboxkit.ops.logs import setup_logging

# Messages, table names, topics and errors are data, never markup: "outboxkit[embedded]"
# must print as written. Styled output is built from Text objects instead.
console = Console(markup=False, highlight=False)
err_console = Console(stderr=True, markup=False, highlight=False)


def library_default(target: str, name: str) -> Any:
    """The default ``target`` ("module:callable") declares for its parameter ``name``.

    The CLI restates no default of the library: it reads them here, when a command
    needs one or ``--help`` shows one.
    """
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return inspect.signature(obj).parameters[name].default


class LibraryOption(click.Option):
    """An option whose default is the library's, read from the signature that declares it.

    ``default_from``: ("module:callable", parameter), or a function giving the text to
    show. Unset, the option's value is None and the command passes nothing, so the
    library's own default applies; with ``resolve=True`` the command gets the library's
    value instead (it needs it itself, e.g. to name the table in its output).
    """

    def __init__(
        self,
        *args: Any,
        default_from: tuple[str, str] | Callable[[], str],
        resolve: bool = False,
        **kwargs: Any,
    ) -> None:
        self.default_from = default_from
        if resolve:
            kwargs["default"] = self.library_value
        super().__init__(*args, **kwargs)

    def library_value(self) -> Any:
        if callable(self.default_from):
            return self.default_from()
        return library_default(*self.default_from)

    def get_help_extra(self, ctx: click.Context) -> Any:
        extra = super().get_help_extra(ctx)
        try:
            value = self.library_value()
        except ModuleNotFoundError:  # an extra this install lacks: the command will say which
            return extra
        if value is not None and value != "":
            extra["default"] = str(value)
        return extra


def _given(**options: Any) -> dict[str, Any]:
    """The options the user set (None: unset, the library's default applies)."""
    return {name: value for name, value in options.items() if value is not None}


def _batch_shape_help(index: int) -> Callable[[], str]:
    """Help text for a value each publisher chooses: its batch_shape, read per broker."""

    def text() -> str:
        from outboxkit.publishers import batch_shapes

        shapes = batch_shapes()
        by_value: dict[int, list[str]] = {}
        missing: list[str] = []
        for scheme, shape in shapes.items():
            if scheme.endswith("s") and scheme[:-1] in shapes:
                continue  # rediss, amqps, https: shown as redis[s] ...
            broker = f"{scheme}[s]" if f"{scheme}s" in shapes else scheme
            if shape is None:
                missing.append(broker)
            else:
                by_value.setdefault(shape[index], []).append(broker)
        parts = [f"{v} for {', '.join(names)}" for v, names in by_value.items()]
        if missing:
            parts.append(f"{', '.join(missing)} not installed")
        return "the broker's: " + "; ".join(parts)

    return text


_RELAY = "outboxkit.relay:Relay"
_METRICS = "outboxkit.ops.metrics:RelayMetrics"
_DEMO = "outboxkit.ops.demo:run_demo"

_DSN_HELP = (
    "PostgreSQL connection string, e.g. postgresql://app@127.0.0.1:5432/shop."
    " Prefer the OUTBOXKIT_DSN environment variable: it keeps the password out of `ps`."
)
_TABLE_HELP = "Outbox table name, optionally schema-qualified (schema.table)."

dsn_option = click.option(
    "--dsn", envvar="OUTBOXKIT_DSN", required=True, show_envvar=True, help=_DSN_HELP
)
table_option = click.option(
    "--table",
    cls=LibraryOption,
    default_from=("outboxkit.store.postgres:Statements", "table"),
    resolve=True,
    envvar="OUTBOXKIT_TABLE",
    show_envvar=True,
    help=_TABLE_HELP,
)

inbox_option = click.option(
    "--inbox", is_flag=True, help="Act on the consumer inbox table instead of the outbox."
)
inbox_table_option = click.option(
    "--inbox-table",
    cls=LibraryOption,
    default_from=("outboxkit.store.inbox_sql:InboxStatements", "table"),
    resolve=True,
    envvar="OUTBOXKIT_INBOX_TABLE",
    show_envvar=True,
    help="Inbox table name (with --inbox), optionally schema-qualified.",
)

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(w|d|h|m|s)", re.IGNORECASE)
_UNIT_SECONDS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> dt.timedelta:
    """``7d``, ``12h``, ``1h30m``, ``90s``, ``2w`` → timedelta."""
    cleaned = text.strip().replace(" ", "")
    parts = _DURATION.findall(cleaned)
    if not cleaned or "".join(n + u for n, u in parts).lower() != cleaned.lower():
        raise click.BadParameter(
            f"{text!r} is not a duration; write e.g. 7d, 12h, 1h30m, 90s (units w d h m s)"
        )
    return dt.timedelta(seconds=sum(float(n) * _UNIT_SECONDS[u.lower()] for n, u in parts))


def _fail(message: str, code: int = 1) -> NoReturn:
    # soft_wrap: one line whatever the terminal width, so it greps and pastes whole.
    err_console.print(Text.assemble(("error:", "bold red"), " ", redact(message)), soft_wrap=True)
    sys.exit(code)


def _ok(message: str) -> None:
    console.print(Text.assemble(("✓", "green"), " ", message), soft_wrap=True)


def _run_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Turn expected failures into one readable line and an exit code, never a traceback."""
    import psycopg

    try:
        return fn(*args, **kwargs)
    except OutboxkitError as exc:
        _fail(str(exc), 2)
    except psycopg.OperationalError as exc:
        first = first_line(exc)
        _fail(f"cannot reach the database: {first} — check --dsn and that PostgreSQL is up", 3)
    except ValueError as exc:
        _fail(str(exc), 2)


class _Commands(click.Group):
    """A command that needs a library this install lacks says which extra brings it."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as exc:
            if isinstance(exc, OutboxkitError):
                _fail(str(exc), 2)
            if (exc.name or "outboxkit").startswith("outboxkit"):
                raise  # a broken install or a bug: the traceback is what helps
            _fail(str(missing_extra(exc, f"`outboxkit {ctx.invoked_subcommand}`")), 2)


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="outboxkit")
def main() -> None:
    """outboxkit — the transactional outbox for PostgreSQL.

    \b
    Write events in the same transaction as your business change (Outbox.put),
    then run relays that publish them to your broker with at-least-once delivery.

    \b
    Typical setup:
      outboxkit migrate --dsn postgresql://app@db/shop
      outboxkit relay   --dsn postgresql://app@db/shop --broker kafka://kafka:9092
      outboxkit status  --dsn postgresql://app@db/shop
    """


# -- migrate ------------------------------------------------------------------------


@main.command()
@click.option("--dsn", envvar="OUTBOXKIT_DSN", show_envvar=True, help=_DSN_HELP)
@table_option
@click.option("--print-sql", is_flag=True, help="Print the DDL instead of running it.")
@inbox_option
@inbox_table_option
@click.option(
    "--partition-by",
    type=click.Choice(["day", "hour"]),
    default=None,
    help="Create the outbox range-partitioned by created_at (UTC days or hours): published"
    " rows leave by dropping whole partitions (see `outboxkit partitions --help`).",
)
@click.option(
    "--ordered",
    is_flag=True,
    help="Add ordered mode (relay --ordered: per-key order across relays): a partition column"
    " hashed from the key, two indexes and the partition lease tables. Rewrites the table"
    " once; tables without it pay nothing.",
)
@click.option(
    "--partitions",
    type=click.IntRange(min=1, max=32767),
    default=None,
    help="With --ordered: how many partitions the keys hash into, the most relays that can"
    " share the work [default: 64, or the table's current count].",
)
@click.option(
    "--repartition",
    is_flag=True,
    help="With --ordered --partitions N: change the count of an ordered table. Stop every"
    " relay first (refused while one is alive); rewrites the table.",
)
def migrate(
    dsn: str | None,
    table: str,
    print_sql: bool,
    inbox: bool,
    inbox_table: str,
    partition_by: str | None,
    ordered: bool,
    partitions: int | None,
    repartition: bool,
) -> None:
    """Create or upgrade the outbox table (idempotent; safe from several processes at once).

    With --inbox, create the consumer-side inbox table (processed_events) instead.

    \b
    Examples:
      outboxkit migrate --dsn postgresql://app@db/shop
      outboxkit migrate --print-sql --table events.outbox > V42__outbox.sql
      outboxkit migrate --inbox --dsn postgresql://app@db/billing
      outboxkit migrate --partition-by day --dsn postgresql://app@db/shop
      outboxkit migrate --ordered --partitions 64 --dsn postgresql://app@db/shop
    """
    from outboxkit.store.migrate import migrate as run_migrate
    from outboxkit.store.postgres import Statements

    if inbox:
        _migrate_inbox(dsn, inbox_table, print_sql)
        return
    if (partitions is not None or repartition) and not ordered:
        _fail("--partitions and --repartition apply to ordered mode: add --ordered", 2)
    ordered_options = _given(partitions=partitions) | ({"repartition": True} if repartition else {})
    if print_sql and ordered:
        from outboxkit.store.ordered_sql import DEFAULT_PARTITIONS, OrderedStatements

        try:
            stmts = OrderedStatements(table)
            click.echo(stmts.ddl(), nl=False)
            if repartition:
                click.echo(stmts.repartition_ddl(), nl=False)
            click.echo(stmts.ordered_ddl(partitions or DEFAULT_PARTITIONS), nl=False)
        except ConfigurationError as exc:
            _fail(str(exc), 2)
        return
    if print_sql:
        try:
            if partition_by is not None:
                from outboxkit.store.partitions import partitioned_script

                click.echo(partitioned_script(table, partition_by), nl=False)
                return
            click.echo(Statements(table).ddl(), nl=False)
        except ConfigurationError as exc:
            _fail(str(exc), 2)
        return
    if not dsn:
        _fail("give --dsn (or set OUTBOXKIT_DSN), or use --print-sql to get the DDL", 2)
    if ordered:
        ordered_options["ordered"] = True
    result = _run_guarded(
        run_migrate, dsn, table=table, **_given(partition_by=partition_by), **ordered_options
    )
    _ok(result.describe())


def _migrate_inbox(dsn: str | None, inbox_table: str, print_sql: bool) -> None:
    from outboxkit.store.inbox_sql import InboxStatements
    from outboxkit.store.migrate import migrate_inbox

    if print_sql:
        try:
            click.echo(InboxStatements(inbox_table).ddl(), nl=False)
        except ConfigurationError as exc:
            _fail(str(exc), 2)
        return
    if not dsn:
        _fail("give --dsn (or set OUTBOXKIT_DSN), or use --print-sql to get the DDL", 2)
    result = _run_guarded(migrate_inbox, dsn, table=inbox_table)
    _ok(result.describe())


# -- relay --------------------------------------------------------------------------


@main.command()
@dsn_option
@click.option(
    "--broker",
    envvar="OUTBOXKIT_BROKER",
    required=True,
    show_envvar=True,
    help="Broker URL: kafka://, nats://, amqp[s]://, redis[s]://, sqs://QUEUE or an http[s]://"
    " webhook; the options of each are linked below.",
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
    cls=LibraryOption,
    default_from=_batch_shape_help(0),
    type=click.IntRange(min=1),
    help="Events claimed per batch.",
)
@click.option(
    "--max-in-flight",
    cls=LibraryOption,
    default_from=_batch_shape_help(1),
    type=click.IntRange(min=1),
    help="Batches claimed but not yet settled at once, so the next claim overlaps the publish.",
)
@click.option(
    "--synchronous-commit",
    cls=LibraryOption,
    default_from=(_RELAY, "synchronous_commit"),
    is_flag=True,
    default=None,
    help="Make the relay's own claims and settles wait for the WAL flush. Without it, losing"
    " one in a database crash only re-publishes events, never loses them.",
)
@click.option(
    "--poll-interval",
    cls=LibraryOption,
    default_from=(_RELAY, "poll_interval"),
    type=float,
    help="Seconds between polls when idle (NOTIFY usually wakes the relay sooner).",
)
@click.option(
    "--linger",
    cls=LibraryOption,
    default_from=(_RELAY, "linger"),
    type=click.FloatRange(min=0),
    help="Seconds a relay that found work keeps looking (after 2, 4, 8, ... ms) before it"
    " waits for a NOTIFY. Writers notify only while a relay waits, so a busy relay spares"
    " them NOTIFY's commit-time lock; 0 waits at once (lowest CPU when idle).",
)
@click.option(
    "--lease",
    cls=LibraryOption,
    default_from=(_RELAY, "lease"),
    type=float,
    help="Seconds a claim is held; a crashed relay's rows are re-claimed after it.",
)
@click.option(
    "--publish-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds one batch's publish may take before it is retried [default: 0.8 x --lease]."
    " It may exceed --lease: a publish still running extends its rows' lease every lease/3"
    " (a slow webhook is not cut at the lease); a relay that dies stops extending.",
)
@click.option(
    "--max-attempts",
    cls=LibraryOption,
    default_from=(_RELAY, "max_attempts"),
    type=int,
    help="Publish attempts before an event is dead-lettered (status failed).",
)
@click.option(
    "--retention",
    cls=LibraryOption,
    default_from=(_RELAY, "retention"),
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
    cls=LibraryOption,
    default_from=(_RELAY, "retry_base"),
    type=float,
    help="First retry delay cap (s).",
)
@click.option(
    "--retry-cap",
    cls=LibraryOption,
    default_from=(_RELAY, "retry_cap"),
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
@click.option(
    "--shutdown-timeout",
    cls=LibraryOption,
    default_from=(_RELAY, "shutdown_timeout"),
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
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one object per line (ts, level, logger, msg, fields) for log pipelines.",
)
@click.option(
    "--log-interval",
    cls=LibraryOption,
    default_from=("outboxkit.relay.observer:SummaryLog", "interval"),
    type=float,
    help="Seconds between INFO summaries of claims and publishes (failures are logged at once).",
)
@click.option(
    "--metrics-port",
    type=int,
    envvar="OUTBOXKIT_METRICS_PORT",
    show_envvar=True,
    default=None,
    help="Serve /metrics (Prometheus), /healthz and /readyz on this port [default: off].",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Interface for --metrics-port; 0.0.0.0 to be scraped from other hosts or pods"
    " (see the operations guide linked below: with --dashboard that shows payloads to"
    " whoever reaches it).",
)
@click.option(
    "--metrics-max-topics",
    cls=LibraryOption,
    default_from=(_METRICS, "max_topics"),
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
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    help="With --dashboard: a Host name it answers to besides IP addresses and localhost"
    " (repeat it; names not listed are refused against DNS rebinding).",
)
@click.option(
    "--admin-token",
    envvar="OUTBOXKIT_ADMIN_TOKEN",
    show_envvar=True,
    default=None,
    help="With --dashboard: enables replay/discard for whoever enters it [default: read-only].",
)
@click.option(
    "--gauge-interval",
    cls=LibraryOption,
    default_from=(_METRICS, "gauge_interval"),
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
    default_from=(_RELAY, "dead_letter_policy"),
    type=click.Choice(["block", "skip"]),
    help="With --ordered, when a key's head event is dead-lettered: block stops the key until"
    " `outboxkit replay` (or discard) of that event, safe for state changes; skip publishes"
    " the key's later events without it.",
)
def relay(
    dsn: str,
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

    \b
    Example:
      OUTBOXKIT_DSN=postgresql://app:secret@db/shop \\
        outboxkit relay --broker kafka://kafka-1:9092,kafka-2:9092

    \b
    Broker URLs and their options, and the operations guide:
      https://github.com/outboxkit/outboxkit/blob/main/docs/brokers.md
      https://github.com/outboxkit/outboxkit/blob/main/docs/operations.md
    """
    from outboxkit.publishers import from_url
    from outboxkit.relay import Relay

    setup_logging(log_level, log_format)
    if with_dashboard and metrics_port is None:
        _fail("--dashboard is served on the metrics port: give --metrics-port too", 2)
    try:
        from outboxkit.publishers.routing import with_routes

        publisher = with_routes(from_url(broker), routes)
        observer, metrics = _relay_observer(
            dsn,
            table,
            broker,
            metrics_port,
            summary=_given(interval=log_interval),
            metrics=_given(
                gauge_interval=gauge_interval,
                max_topics=metrics_max_topics,
                topics=metrics_topics or None,
            ),
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
        engine = Relay(dsn, publisher, table=table, observer=observer, **_given(**relay_options))
    except OutboxkitError as exc:
        _fail(str(exc), 2)

    async def _main() -> None:
        from outboxkit.ops.http import metrics_app, raise_open_file_limit, serving

        raise_open_file_limit()  # HTTP clients must not take the sockets the relay needs
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
        async with serving(metrics_app(metrics, dashboard=board), metrics_host, metrics_port):
            gauges = asyncio.create_task(metrics.run_gauges())
            try:
                await engine.run()
            finally:
                gauges.cancel()
                await asyncio.gather(gauges, return_exceptions=True)

    try:
        asyncio.run(_main())
    except OutboxkitError as exc:
        _fail(str(exc), 2)


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

    from outboxkit.relay.observer import BatchTracing, Observers, SummaryLog
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


# -- status -------------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


@main.command()
@dsn_option
@table_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for programs.")
def status(dsn: str, table: str, as_json: bool) -> None:
    """Pending, in-flight, failed and published counts, and the oldest pending age.

    With --json prints one object with the keys pending, in_flight, failed,
    published, oldest_pending_age_s, topics (a list of the same per topic) and
    blocked_keys (ordered mode: keys stopped behind a dead-lettered head event, each
    with the head's id, event_id, topic, event_type, attempts, last_error, created_at
    and the count of events waiting behind it; empty on an unordered table).
    """
    from outboxkit.store import admin
    from outboxkit.store.ordered_sql import blocked_keys

    report = _run_guarded(admin.status, dsn, table)
    blocked = _run_guarded(blocked_keys, dsn, table=table, limit=_BLOCKED_KEYS_SHOWN)
    for head in blocked:
        head["last_error"] = redact(head["last_error"] or "")
    if as_json:
        shown = [{k: _jsonable(v) for k, v in head.items()} for head in blocked]
        click.echo(json.dumps({**report.as_dict(), "blocked_keys": shown}))
        return
    tbl = Table(title=Text(f"{table} by topic"), title_justify="left")
    for col in ("topic", "pending", "in flight", "failed", "published", "oldest pending"):
        tbl.add_column(col, justify="left" if col == "topic" else "right")
    for t in report.topics:
        tbl.add_row(
            Text(t.topic),
            str(t.pending),
            str(t.in_flight),
            Text(str(t.failed), style="red") if t.failed else "0",
            str(t.published),
            _age(t.oldest_pending_age_s),
        )
    tbl.add_section()
    tbl.add_row(
        Text("total", style="bold"),
        str(report.pending),
        str(report.in_flight),
        Text(str(report.failed), style="bold red") if report.failed else "0",
        str(report.published),
        _age(report.oldest_pending_age_s),
    )
    console.print(tbl)
    if blocked:
        _print_blocked_keys(table, blocked)
    if report.failed:
        console.print(
            Text.assemble(("dead letters present:", "yellow"), " see `outboxkit failed list`")
        )
    from outboxkit.store.partitions import stray_rows

    if stray := _run_guarded(stray_rows, dsn, table):  # a partitioned outbox's default partition
        console.print(
            Text.assemble(
                ("rows outside every partition:", "yellow"),
                f" {stray} in the default partition; see `outboxkit partitions list`",
            )
        )


_BLOCKED_KEYS_SHOWN = 100


def _print_blocked_keys(table: str, blocked: list[dict[str, Any]]) -> None:
    """Ordered mode: each key stopped behind its dead-lettered head event, with its error."""
    more = "+" if len(blocked) >= _BLOCKED_KEYS_SHOWN else ""
    tbl = Table(
        title=Text(
            f"{table}: {len(blocked)}{more} blocked key(s), each behind a failed head event"
        ),
        title_justify="left",
    )
    for col in ("key", "head id", "topic", "attempts", "waiting", "head event's error"):
        tbl.add_column(
            col, justify="right" if col in ("head id", "attempts", "waiting") else "left"
        )
    for head in blocked:
        tbl.add_row(
            Text(str(head["key"])),
            str(head["id"]),
            Text(str(head["topic"])),
            str(head["attempts"]),
            str(head["waiting"]),
            Text((str(head["last_error"] or "-").splitlines() or ["-"])[0][:200], style="red"),
        )
    console.print(tbl)
    console.print(
        Text.assemble(
            ("blocked keys:", "yellow"),
            " fix the cause, then `outboxkit replay --id <head id>` (or discard the head from"
            " the dashboard) to let the key go on",
        )
    )


# -- failed / replay / purge --------------------------------------------------------


@main.group()
def failed() -> None:
    """Inspect dead-lettered events (status failed)."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode("utf-8", "replace")
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if hasattr(value, "hex") and type(value).__name__ == "UUID":
        return str(value)
    return value


@failed.command("list")
@dsn_option
@table_option
@click.option("--topic", default=None, help="Only this topic.")
@click.option(
    "--limit",
    cls=LibraryOption,
    default_from=("outboxkit.store.admin:list_failed", "limit"),
    type=click.IntRange(min=1),
    help="List at most this many events (the oldest first).",
)
@click.option("--json", "as_json", is_flag=True, help="A JSON array, for programs.")
def failed_list(dsn: str, table: str, topic: str | None, limit: int | None, as_json: bool) -> None:
    """List dead-lettered events, oldest first."""
    from outboxkit.store import admin

    rows = _run_guarded(admin.list_failed, dsn, table, topic=topic, **_given(limit=limit))
    if as_json:
        click.echo(json.dumps([{k: _jsonable(v) for k, v in r.items()} for r in rows]))
        return
    if not rows:
        console.print(Text("no failed events", style="green"))
        return
    tbl = Table(title=Text(f"failed events in {table}"), title_justify="left")
    for col in ("id", "event id", "topic", "type", "attempts", "last error"):
        tbl.add_column(col, overflow="fold")
    for r in rows:
        tbl.add_row(
            str(r["id"]),
            str(r["event_id"]),
            Text(r["topic"]),
            Text(r["event_type"]),
            str(r["attempts"]),
            Text((r["last_error"] or "")[:120]),
        )
    console.print(tbl)
    console.print("replay with: outboxkit replay --id ID | --topic T | --all-failed")


@failed.command("show")
@click.argument("ref")
@dsn_option
@table_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for programs.")
def failed_show(ref: str, dsn: str, table: str, as_json: bool) -> None:
    """Show one event (by row id or event id), headers and payload included."""
    from outboxkit.store import admin

    row = _run_guarded(admin.get_event, dsn, ref, table)
    if row is None:
        _fail(f"no event {ref!r} in {table}", 1)
    data = {k: _jsonable(v) for k, v in row.items()}
    if as_json:
        click.echo(json.dumps(data))
        return
    tbl = Table(show_header=False, title=Text(f"event {ref}"), title_justify="left")
    tbl.add_column("field", style="bold")
    tbl.add_column("value", overflow="fold")
    for k, v in data.items():
        text = json.dumps(v, indent=2) if isinstance(v, dict | list) else str(v)
        tbl.add_row(k, Text(text[:4000]))
    console.print(tbl)


@main.command()
@dsn_option
@table_option
@click.option("--id", "ids", multiple=True, type=int, help="Row id to replay (repeatable).")
@click.option("--topic", default=None, help="Replay every failed event of this topic.")
@click.option("--all-failed", is_flag=True, help="Replay every failed event.")
def replay(dsn: str, table: str, ids: tuple[int, ...], topic: str | None, all_failed: bool) -> None:
    """Put dead-lettered events back in line with a fresh attempt budget.

    Exactly one of --id, --topic or --all-failed.
    """
    from outboxkit.store import admin

    if sum(bool(x) for x in (ids, topic, all_failed)) != 1:
        _fail("say what to replay: --id ID (repeatable), --topic T, or --all-failed", 2)
    n = _run_guarded(
        admin.replay, dsn, table, ids=list(ids) or None, topic=topic, all_failed=all_failed
    )
    _ok(f"{n} event(s) back to pending")


@main.command()
@dsn_option
@table_option
@click.option(
    "--older-than", required=True, help="Age of published rows to delete, e.g. 7d, 12h, 1h30m."
)
@click.option(
    "--batch-size",
    cls=LibraryOption,
    default_from=("outboxkit.store.admin:purge", "batch_size"),
    type=click.IntRange(min=1),
    help="Rows per transaction.",
)
@click.option("--json", "as_json", is_flag=True, help='Print {"deleted": N} only, for programs.')
@inbox_option
@inbox_table_option
@click.option("--consumer", default=None, help="With --inbox: only this consumer's records.")
def purge(
    dsn: str,
    table: str,
    older_than: str,
    batch_size: int | None,
    as_json: bool,
    inbox: bool,
    inbox_table: str,
    consumer: str | None,
) -> None:
    """Delete published rows (retention=keep) older than a duration, in small batches.

    With --inbox, delete inbox records older than the duration instead; keep
    them longer than any redelivery can arrive (a purged record no longer
    stops a late duplicate).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from outboxkit.store import admin, inbox_sql

    age = parse_duration(older_than)

    def run_purge(**kw: Any) -> Any:
        kw.update(_given(batch_size=batch_size))
        if inbox:
            return _run_guarded(
                inbox_sql.purge_inbox,
                dsn,
                older_than=age,
                table=inbox_table,
                consumer=consumer,
                **kw,
            )
        return _run_guarded(admin.purge, dsn, table, older_than=age, **kw)

    if as_json:
        click.echo(json.dumps({"deleted": run_purge()}))
        return
    if inbox:
        total = _run_guarded(
            inbox_sql.count_inbox_purgeable,
            dsn,
            older_than=age,
            table=inbox_table,
            consumer=consumer,
        )
    else:
        total = _run_guarded(admin.count_purgeable, dsn, table, age)
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("purging", total=total)
        n = run_purge(progress=lambda k: progress.advance(task, k))
    what = "inbox record(s)" if inbox else "published row(s)"
    _ok(f"deleted {n} {what} older than {older_than}")


# -- dashboard ----------------------------------------------------------------------


@main.command()
@dsn_option
@table_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=8080, show_default=True, help="Port to listen on.")
@click.option(
    "--admin-token",
    envvar="OUTBOXKIT_ADMIN_TOKEN",
    show_envvar=True,
    default=None,
    help="Enables replay/discard for whoever enters this token [default: read-only].",
)
@click.option(
    "--sample-interval",
    cls=LibraryOption,
    default_from=("outboxkit.ops.dashboard:Dashboard", "sample_interval"),
    type=float,
    help="Seconds between table reads.",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    help="A Host name the page answers to besides IP addresses and localhost (repeat it;"
    " names not listed are refused against DNS rebinding).",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one object per line, for log pipelines (actions taken are logged).",
)
def dashboard(
    dsn: str,
    table: str,
    host: str,
    port: int,
    admin_token: str | None,
    sample_interval: float | None,
    allow_hosts: tuple[str, ...],
    log_format: str,
) -> None:
    """Serve a web page with live throughput, backlog, topics and dead letters.

    Read-only unless started with --admin-token (or OUTBOXKIT_ADMIN_TOKEN): then
    failed events can be replayed or discarded by whoever enters the token;
    every action is logged.

    \b
    Example:
      OUTBOXKIT_ADMIN_TOKEN=$(openssl rand -hex 16) outboxkit dashboard --dsn ... --port 8080
    """
    from outboxkit.ops.dashboard import Dashboard, dashboard_app
    from outboxkit.store import admin

    setup_logging("info", log_format)
    _run_guarded(admin.live_status, dsn, table)  # fail now, readably, if the DSN or table is wrong
    try:
        board = Dashboard(
            dsn,
            table=table,
            admin_token=admin_token,
            host=host,
            allowed_hosts=allow_hosts,
            **_given(sample_interval=sample_interval),
        )
    except OutboxkitError as exc:
        _fail(str(exc), 2)
    mode = "replay/discard enabled (token)" if admin_token else "read-only"
    try:
        asyncio.run(_serve_dashboard(dashboard_app(board), host, port, mode))
    except OutboxkitError as exc:
        _fail(str(exc), 2)


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


# -- demo ---------------------------------------------------------------------------


@main.command()
@click.option(
    "--orders",
    cls=LibraryOption,
    default_from=(_DEMO, "orders"),
    type=int,
    help="Orders to place per path.",
)
@click.option(
    "--duration",
    cls=LibraryOption,
    default_from=(_DEMO, "duration"),
    type=float,
    help="Seconds over which orders are placed.",
)
@click.option(
    "--broker",
    default=None,
    help="nats:// URL of a NATS JetStream you already run [default: an embedded one].",
)
@click.option("--dsn", default=None, help="PostgreSQL to use [default: an embedded one].")
@click.option("--json", "as_json", is_flag=True, help="Print the result table as JSON.")
@click.option(
    "--source",
    type=click.Choice(["poll", "cdc"]),
    default="poll",
    show_default=True,
    help="cdc: the relays stream a replication slot (the embedded PostgreSQL starts with"
    " wal_level=logical; one relay streams, the other is its standby and takes over when the"
    " first is SIGKILLed).",
)
def demo(
    orders: int | None,
    duration: float | None,
    broker: str | None,
    dsn: str | None,
    as_json: bool,
    source: str,
) -> None:
    """Show the dual-write problem and the outbox closing it, under real faults.

    Starts an embedded PostgreSQL and NATS JetStream (no install needed), places
    orders at a steady rate through two paths — naive "commit then publish" and
    the outbox — while the broker is stopped and restarted and a relay is
    SIGKILLed mid-batch. Exits 0 only if the outbox path lost nothing.
    """
    from outboxkit.ops.demo import run_demo

    ok = _run_guarded(
        run_demo,
        broker=broker,
        dsn=dsn,
        as_json=as_json,
        source=source,
        **_given(orders=orders, duration=duration),
    )
    sys.exit(0 if ok else 1)


# Registered last: each group's module uses this one's options and helpers and adds its
# group to `main` itself (so importing either module on its own works too).
importlib.import_module("outboxkit.ops.partitions_cli")  # `outboxkit partitions`
importlib.import_module("outboxkit.ops.cdc_cli")  # `outboxkit cdc`

if __name__ == "__main__":  # pragma: no cover
    main()
