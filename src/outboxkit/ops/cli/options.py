"""The options several commands share, and defaults read from the library, never restated."""

from __future__ import annotations

import datetime as dt
import importlib
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import click

from outboxkit.errors import ConfigurationError


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


def given(**options: Any) -> dict[str, Any]:
    """The options the user set (None: unset, the library's default applies)."""
    return {name: value for name, value in options.items() if value is not None}


def batch_shape_help(index: int) -> Callable[[], str]:
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


RELAY = "outboxkit.relay:Relay"
METRICS = "outboxkit.ops.metrics:RelayMetrics"
DEMO = "outboxkit.ops.demo:run_demo"

DSN_HELP = (
    "PostgreSQL connection string, e.g. postgresql://app@127.0.0.1:5432/shop."
    " Prefer the OUTBOXKIT_DSN environment variable: it keeps the password out of `ps`."
)
_TABLE_HELP = "Outbox table name, optionally schema-qualified (schema.table)."


def check_dsn(dsn: str) -> None:
    """Refuse a DSN its database's driver cannot parse, in one line without its secrets:
    the backend the URL names checks it (libpq's parse on PostgreSQL)."""
    from outboxkit.backends import backend_for

    backend_for(dsn).check_dsn(dsn, name="--dsn (or OUTBOXKIT_DSN)")


def checked_dsn(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """A click callback: :func:`check_dsn` on the value given, if any."""
    if value is not None:
        check_dsn(value)
    return value


_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def dsn_option_of(
    *, required: bool = True, help_text: str = DSN_HELP, envvar: bool | None = None
) -> _Decorator:
    """``--dsn``, checked at parse time; ``envvar`` (by default: a required one) also reads
    ``OUTBOXKIT_DSN``."""
    envvar = required if envvar is None else envvar
    return click.option(
        "--dsn",
        required=required,
        default=None,
        help=help_text,
        callback=checked_dsn,
        envvar="OUTBOXKIT_DSN" if envvar else None,
        show_envvar=envvar,
    )


dsn_option = dsn_option_of()


def dsn_or_file_options(file_help: str) -> _Decorator:
    """``--dsn`` (or ``OUTBOXKIT_DSN``), or ``--dsn-file`` (``dsn_file``): one database, or
    every database of a file (outboxkit.fleet); the command refuses both or neither
    (:func:`one_of_dsn_or_file`)."""
    dsn = dsn_option_of(required=False, envvar=True, help_text=DSN_HELP + " Or --dsn-file.")
    dsn_file = click.option(
        "--dsn-file", type=click.Path(dir_okay=False), default=None, help=file_help
    )
    return lambda command: dsn(dsn_file(command))


def reload_interval_option(who: str) -> _Decorator:
    """``--reload-interval``: seconds between reads of ``--dsn-file`` (``who``: "relay"...),
    and ``--fleet-lease``: the lease by which processes given the same file divide it."""
    lease = click.option(
        "--fleet-lease",
        callback=positive_seconds_range,
        cls=LibraryOption,
        default_from=("outboxkit.fleet.supervisor:Fleet", "lease"),
        type=float,
        help=f"With --dsn-file: the lease (seconds) on each database by which processes given"
        f" the same file divide its databases (one {who} per database, checked every third of"
        f" it; a dead process's databases are taken over within about one lease).",
    )
    interval = click.option(
        "--reload-interval",
        callback=positive_seconds_range,
        cls=LibraryOption,
        default_from=("outboxkit.fleet.supervisor:Fleet", "reload_interval"),
        type=float,
        help=f"With --dsn-file: seconds between reads of the file (SIGHUP reads it at once):"
        f" a database added gets a {who}, a removed one's {who} stops.",
    )
    return lambda command: interval(lease(command))


def one_of_dsn_or_file(dsn: str | None, dsn_file: str | None) -> None:
    """ConfigurationError unless exactly one of ``--dsn`` and ``--dsn-file`` was given."""
    if dsn is not None and dsn_file is not None:
        raise ConfigurationError(
            "--dsn (or OUTBOXKIT_DSN) and --dsn-file both name databases: give one of them"
        )
    if dsn is None and dsn_file is None:
        raise ConfigurationError("give --dsn (or OUTBOXKIT_DSN), or --dsn-file")


_POOLERS = ["auto", "none", "session", "transaction", "transaction-prepared"]


def pooler_options(who: str, *, session_needs: str, through_dsn: str) -> _Decorator:
    """``--pooler`` and ``--direct-dsn``: what sits in front of PostgreSQL, and the way around it.

    ``who`` ("relay", "worker") names the command; ``session_needs`` what needs a session
    of PostgreSQL itself; ``through_dsn`` what still goes through ``--dsn``.
    """
    pooler = click.option(
        "--pooler",
        type=click.Choice(_POOLERS),
        default=None,
        help=f"What sits between the {who} and PostgreSQL [default: auto, found at the first"
        " connection]. transaction: a transaction pooler keeping no prepared statements"
        " (PgBouncer < 1.21); transaction-prepared: one keeping them (1.21+"
        " max_prepared_statements); session or none: everything works. README, 'Behind"
        " PgBouncer'.",
    )
    direct = click.option(
        "--direct-dsn",
        envvar="OUTBOXKIT_DIRECT_DSN",
        show_envvar=True,
        default=None,
        help="Behind a transaction pooler: a DSN of PostgreSQL itself for what needs a session"
        f" ({session_needs}); {through_dsn} still go through --dsn. Without it the {who}"
        " polls.",
    )
    return lambda command: pooler(direct(command))


def metrics_options(serves: str, *, port_envvar: bool = False, host_note: str = "") -> _Decorator:
    """``--metrics-port`` (off unless given) and ``--metrics-host`` (loopback by default).

    ``serves``: the endpoints the port answers; ``host_note``: a sentence added to the
    host's help. ``port_envvar``: ``OUTBOXKIT_METRICS_PORT`` sets the port too.
    """
    port = click.option(
        "--metrics-port",
        callback=port_range,
        type=int,
        default=None,
        help=f"Serve {serves} on this port [default: off].",
        envvar="OUTBOXKIT_METRICS_PORT" if port_envvar else None,
        show_envvar=port_envvar,
    )
    host = click.option(
        "--metrics-host",
        default="127.0.0.1",
        show_default=True,
        help="Interface for --metrics-port; 0.0.0.0 to be scraped from other hosts or pods"
        + (f" {host_note}" if host_note else "")
        + ".",
    )
    return lambda command: port(host(command))


def json_option(help_text: str) -> _Decorator:
    """``--json`` (``as_json``): print for programs; ``help_text`` says the shape printed."""
    return click.option("--json", "as_json", is_flag=True, help=help_text)


def log_format_option(help_text: str) -> _Decorator:
    """``--log-format``: text, or json (one object per line); ``help_text`` says for whom."""
    return click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help=help_text,
    )


def tasks_table_option(
    help_text: str = "Task table name, optionally schema-qualified.",
) -> _Decorator:
    """``--tasks-table`` (``OUTBOXKIT_TASKS_TABLE``): task mode's table."""
    return click.option(
        "--tasks-table",
        default="outboxkit_tasks",
        show_default=True,
        envvar="OUTBOXKIT_TASKS_TABLE",
        help=help_text,
    )


def older_than_option(help_text: str) -> _Decorator:
    """``--older-than``, a required duration (7d, 12h, 1h30m), checked at parse time."""
    return click.option("--older-than", required=True, callback=checked_duration, help=help_text)


def allow_host_option(help_text: str) -> _Decorator:
    """``--allow-host`` (``allow_hosts``, repeatable): a dashboard's Host names."""
    return click.option("--allow-host", "allow_hosts", multiple=True, help=help_text)


def admin_token_option(help_text: str) -> _Decorator:
    """``--admin-token`` (``OUTBOXKIT_ADMIN_TOKEN``): a dashboard's actions, off without it."""
    return click.option(
        "--admin-token",
        envvar="OUTBOXKIT_ADMIN_TOKEN",
        show_envvar=True,
        default=None,
        help=help_text,
    )


table_option = click.option(
    "--table",
    cls=LibraryOption,
    default_from=("outboxkit.backends.postgres.postgres:Statements", "table"),
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
    default_from=("outboxkit.backends.postgres.inbox_sql:InboxStatements", "table"),
    resolve=True,
    envvar="OUTBOXKIT_INBOX_TABLE",
    show_envvar=True,
    help="Inbox table name (with --inbox), optionally schema-qualified.",
)

#: The longest time any seconds option or duration takes: past it, timers, timedeltas and
#: PostgreSQL's intervals and timestamps overflow (a year of seconds is more than any needs).
MAX_SECONDS = 365 * 86400
_MAX_DURATION_DAYS = 36500  # 100 years: `now() - interval` stays a valid timestamp
#: PostgreSQL's int (attempts, batch sizes, LIMIT) and bigint (row ids).
MAX_INT4 = 2**31 - 1
MAX_INT8 = 2**63 - 1
MAX_PORT = 65535

_Number = int | float


def in_range(
    low: _Number, high: _Number, *, low_open: bool = False
) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback refusing a number (or each of several) outside ``low``..``high``.

    A callback, not a range type, so ``--help`` reads as before; NaN and infinity are out
    of every range (they passed ``float`` and overflowed far from the option that set them).
    """

    def check(_ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        for number in value if isinstance(value, tuple) else (value,):
            if number is None:
                continue
            inside = (
                math.isfinite(number)
                and high >= number
                and (number > low if low_open else number >= low)
            )
            if not inside:
                above = f"above {low}" if low_open else f"from {low}"
                raise click.BadParameter(
                    f"{number} is out of range: give a number {above} to {high}"
                )
        return value

    return check


#: Seconds options: not negative, at most MAX_SECONDS.
seconds_range = in_range(0, MAX_SECONDS)
#: Seconds options that must be positive.
positive_seconds_range = in_range(0, MAX_SECONDS, low_open=True)
#: Counts stored in or compared with an int column.
count_range = in_range(1, MAX_INT4)
port_range = in_range(0, MAX_PORT)

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
    seconds = sum(float(n) * _UNIT_SECONDS[u.lower()] for n, u in parts)
    if seconds > _MAX_DURATION_DAYS * 86400:
        raise click.BadParameter(
            f"{text!r} is out of range: give at most {_MAX_DURATION_DAYS}d (100 years)"
        )
    return dt.timedelta(seconds=seconds)


def checked_duration(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """A click callback: :func:`parse_duration` at parse time, so the error names the option."""
    if value is not None:
        parse_duration(value)
    return value
