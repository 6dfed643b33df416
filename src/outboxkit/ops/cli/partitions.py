"""``outboxkit partitions list | maintain``: the time partitions of a partitioned outbox."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from outboxkit.ops.cli.guard import run_guarded
from outboxkit.ops.cli.options import (
    checked_duration,
    dsn_option,
    in_range,
    json_option,
    parse_duration,
    table_option,
)
from outboxkit.ops.cli.output import console, err_console, id_column, ok

# More periods ahead than any retention needs would be thousands of tables to create.
_MAX_AHEAD = 1000


@click.group()
def partitions() -> None:
    """The time partitions of a partitioned outbox (`outboxkit migrate --partition-by day`).

    \b
    A partitioned outbox keeps published rows (relay --retention keep) and drops a
    whole partition once its range is older than the retention window: no DELETE, no
    dead rows to vacuum. Every relay maintains the partitions every 5 minutes (one at
    a time); `partitions maintain` does the same from a cron job.
    """


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"  # pragma: no cover


def _range(lower: dt.datetime | None, upper: dt.datetime | None) -> str:
    if lower is None or upper is None:
        return "DEFAULT (rows no partition covers)"
    fmt = "%Y-%m-%d %H:%M" if (upper - lower) < dt.timedelta(days=1) else "%Y-%m-%d"
    return f"{lower:{fmt}} → {upper:{fmt}} UTC"


@partitions.command("list")
@dsn_option
@table_option
@click.option(
    "--exact",
    is_flag=True,
    help="Count every partition's rows (a full scan), not estimate.",
)
@json_option("A JSON array, one object per partition.")
def list_command(dsn: str, table: str, exact: bool, as_json: bool) -> None:
    """Each partition: its range, rows, pending and failed events, size.

    \b
    Rows are the planner's estimate unless --exact (the default partition is always
    counted). Pending and failed are counted through the partial indexes: cheap.
    A partition holding failed rows is never dropped: replay or discard them.
    Rows in the DEFAULT partition mean no partition covered their created_at (the
    maintenance was stopped): run `outboxkit partitions maintain`, it moves them.
    """
    from outboxkit.backends.postgres.partitions import list_partitions

    infos = run_guarded(list_partitions, dsn, table, exact=exact)
    if as_json:
        click.echo(json.dumps([i.as_dict() for i in infos]))
        return
    tbl = Table(title=Text(f"{table} partitions"), title_justify="left")
    id_column(tbl, "partition")
    for col in ("range", "rows", "pending", "failed", "size"):
        tbl.add_column(col, justify="left" if col == "range" else "right")
    stray = 0
    for i in infos:
        rows = str(i.rows) if i.rows_exact else f"~{max(i.rows, 0)}"
        if i.is_default:
            stray = i.rows
        tbl.add_row(
            Text(i.name),
            _range(i.lower, i.upper),
            Text(rows, style="bold yellow") if i.is_default and i.rows else rows,
            str(i.pending),
            Text(str(i.failed), style="red") if i.failed else "0",
            _size(i.size_bytes),
        )
    console.print(tbl)
    if stray:
        err_console.print(
            Text.assemble(
                ("warning:", "bold yellow"),
                f" {stray} row(s) in the default partition: no partition covered their"
                " created_at. Run `outboxkit partitions maintain` (it creates their partitions"
                " and moves them in) and check that a relay or a cron job maintains the table.",
            ),
            soft_wrap=True,
        )


@partitions.command("maintain")
@dsn_option
@table_option
@click.option(
    "--keep",
    default=None,
    callback=checked_duration,
    help="Retention window, e.g. 7d, 36h: a partition whose whole range is older is dropped"
    " [default: the table's, see `partitions set`; 7d].",
)
@click.option(
    "--ahead",
    callback=in_range(1, _MAX_AHEAD),
    type=click.IntRange(min=1),
    default=None,
    help="Periods to create after the current one [default: the table's; 3].",
)
@json_option("One JSON object (the report), for programs.")
def maintain_command(
    dsn: str, table: str, keep: str | None, ahead: int | None, as_json: bool
) -> None:
    """Create the partitions ahead, drop the expired ones: run it from cron.

    \b
    Never drops a partition holding a pending or a failed event: it is kept and
    reported (replay or discard dead letters; the next run drops it). Each create or
    drop takes a short exclusive lock on the outbox table and waits at most 2 s for
    it; a busy table is retried at the next run. One run at a time per table: a run
    finding another one (a relay, a cron job) does nothing and says so.

    \b
    Examples:
      outboxkit partitions maintain --dsn postgresql://app@db/shop
      outboxkit partitions maintain --keep 3d --json
      # crontab, every 10 minutes:
      */10 * * * *  OUTBOXKIT_DSN=... outboxkit partitions maintain --json >> /var/log/outbox.log
    """
    from outboxkit.backends.postgres.partitions import maintain

    kwargs: dict[str, Any] = {}
    if keep is not None:
        kwargs["keep"] = parse_duration(keep)
    if ahead is not None:
        kwargs["ahead"] = ahead
    if as_json:
        report = run_guarded(maintain, dsn, table, **kwargs)
        click.echo(json.dumps(report.as_dict()))
        return
    with console.status(f"maintaining the partitions of {table}...") as status:
        report = run_guarded(
            maintain,
            dsn,
            table,
            progress=lambda name: status.update(f"maintaining the partitions of {table}: {name}"),
            **kwargs,
        )
    if report.skipped:
        ok(f"nothing done: {report.skipped}")
        return
    ok(
        f"{table}: created {len(report.created)} partition(s), dropped {len(report.dropped)}"
        + (f", moved {report.moved_rows} stray row(s) in" if report.moved_rows else "")
    )
    for name in report.created:
        console.print(f"  + {name}")
    for name in report.dropped:
        console.print(f"  - {name}")
    for kept in report.kept:
        err_console.print(
            Text.assemble(("kept:", "bold yellow"), f" {kept.name}: {kept.reason}"), soft_wrap=True
        )
    if report.deferred:
        err_console.print(
            Text.assemble(
                ("deferred:", "yellow"),
                f" {', '.join(report.deferred)} (the table was busy: retried at the next run)",
            ),
            soft_wrap=True,
        )
    if report.stray_rows:
        err_console.print(
            Text.assemble(
                ("warning:", "bold yellow"),
                f" {report.stray_rows} row(s) remain in the default partition",
            ),
            soft_wrap=True,
        )


@partitions.command("set")
@dsn_option
@table_option
@click.option(
    "--keep",
    default=None,
    callback=checked_duration,
    help="Retention window the relays and cron use, e.g. 7d.",
)
@click.option(
    "--ahead",
    callback=in_range(1, _MAX_AHEAD),
    type=click.IntRange(min=1),
    default=None,
    help="Periods created ahead.",
)
def set_command(dsn: str, table: str, keep: str | None, ahead: int | None) -> None:
    """Store the table's partition settings (read by every relay and `maintain`).

    \b
    They live in the outbox table's comment (COMMENT ON TABLE), so every relay and cron
    job of the table agree. Example: outboxkit partitions set --keep 3d --ahead 5
    """
    from outboxkit.backends.postgres.partitions import update_settings

    settings = run_guarded(
        update_settings,
        dsn,
        table,
        keep=None if keep is None else parse_duration(keep),
        ahead=ahead,
    )
    ok(
        f"{table}: partitioned by {settings.by}, keep {settings.keep}, "
        f"{settings.ahead} period(s) ahead"
    )
