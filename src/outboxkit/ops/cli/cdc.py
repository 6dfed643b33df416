"""`outboxkit cdc setup | status | drop`: the slot and publication of the WAL relay."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from outboxkit.ops.cli.guard import run_guarded
from outboxkit.ops.cli.options import dsn_option, json_option, table_option
from outboxkit.ops.cli.output import console, fail, ok

slot_option = click.option(
    "--slot", help="Replication slot name [default: outboxkit_<table>, what the relay uses]."
)
publication_option = click.option(
    "--publication", help="Publication name [default: outboxkit_<table>]."
)


@click.group()
def cdc() -> None:
    """The logical replication slot the WAL relay (`relay --source cdc`) reads.

    \b
    The WAL relay reads events from PostgreSQL's logical replication stream instead of
    polling the outbox table. It needs, once per outbox:
      - the server started with wal_level = logical (a restart to change it);
      - a role with REPLICATION (or superuser) that owns the outbox table;
      - a publication of the table's inserts and a pgoutput slot: `cdc setup`.
    A slot keeps every WAL segment its relay has not confirmed: a relay down for a day
    keeps a day of WAL on the server's disk, up to max_slot_wal_keep_size, past which
    the server invalidates the slot. Watch `cdc status` (or the
    outboxkit_cdc_slot_lag_bytes metric). How to size it:
    https://github.com/outboxkit/outboxkit/blob/main/docs/operations.md

    \b
      outboxkit cdc setup  --dsn postgresql://app@db/shop
      outboxkit cdc status --dsn postgresql://app@db/shop [--json]
      outboxkit cdc drop   --dsn postgresql://app@db/shop
    """


@cdc.command()
@dsn_option
@table_option
@slot_option
@publication_option
def setup(dsn: str, table: str, slot: str | None, publication: str | None) -> None:
    """Check the server, then create the publication and the slot (idempotent).

    \b
    Checked first, nothing changed if one fails (each failure says what to do):
      wal_level = logical, a free replication slot, max_wal_senders > 0,
      the role's REPLICATION (or superuser), the table exists and the role owns it.
    The slot starts at the current end of WAL: events written before it are not
    streamed (a table-mode outbox's older rows are left to the polling relay).
    """
    from outboxkit.cdc.slots import setup as setup_slot

    result = run_guarded(setup_slot, dsn, table, slot=slot, publication=publication)
    created = "created" if result.created_publication else "exists"
    ok(f"publication {result.publication} ({created}): inserts into {result.table}")
    if result.created_slot:
        ok(f"slot {result.slot} created at {result.slot_lsn} (plugin pgoutput)")
    else:
        ok(f"slot {result.slot} exists (plugin pgoutput)")
    console.print(f"next: outboxkit relay --source cdc --table {result.table} --broker …")


@cdc.command()
@dsn_option
@table_option
@slot_option
@publication_option
@json_option("Print the status as JSON.")
def status(dsn: str, table: str, slot: str | None, publication: str | None, as_json: bool) -> None:
    """The slot: active, lag in bytes and seconds, WAL retained, invalidation.

    \b
    lag bytes    WAL written since the position the relay confirmed;
    lag seconds  age of the oldest transaction not yet confirmed (0: none waits);
    wal status   reserved/extended: fine; unreserved: about to be invalidated;
                 lost: invalidated, the slot can never stream again (exit code 2,
                 with the recovery steps).
    Exit code 0 when healthy, 2 when the slot is missing or invalidated.
    """
    from outboxkit.cdc.slots import status as slot_status

    report = run_guarded(slot_status, dsn, table, slot=slot, publication=publication)
    if as_json:
        console.print(json.dumps(report.as_dict(), indent=2, default=str), soft_wrap=True)
    else:
        console.print(_status_table(report))
        for note in report.notes:
            console.print(f"note: {note}", soft_wrap=True)
    if report.problem is not None:
        if not as_json:
            fail(report.problem, 2)
        sys.exit(2)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(size) < 1024 or unit == "TB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit} ({n} B)"
        size /= 1024
    return str(n)  # pragma: no cover


def _keep_size(setting: str | None) -> str:
    return "-1 (unlimited)" if setting == "-1" else setting or "-"


def _status_table(report: Any) -> Table:
    table = Table(title=f"slot {report.slot}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    if not report.exists:
        table.add_row("exists", Text("no", style="red"))
        return table
    seconds = "-" if report.lag_seconds is None else f"{report.lag_seconds:.1f} s"
    wal_status = report.wal_status or "-"
    style = "red" if report.invalidated else "yellow" if wal_status == "unreserved" else ""
    active = f"yes (pid {report.active_pid})" if report.active else "no"
    pub = "yes" if report.publication_has_table else "no"
    for name, value in (
        ("active", active),
        ("publication", f"{report.publication} (carries {report.table}: {pub})"),
        ("confirmed flush lsn", report.confirmed_flush_lsn or "-"),
        ("current wal lsn", report.current_lsn or "-"),
        ("lag bytes", _size(report.lag_bytes)),
        ("lag seconds", seconds),
        ("oldest unconfirmed commit", report.oldest_unconfirmed_commit or "-"),
        ("wal retained", _size(report.retained_bytes)),
        ("max_slot_wal_keep_size", _keep_size(report.max_slot_wal_keep_size)),
        ("safe wal size", _size(report.safe_wal_size)),
    ):
        table.add_row(name, value)
    table.add_row("wal status", Text(wal_status, style=style))
    if report.invalidation_reason:
        table.add_row("invalidation reason", Text(report.invalidation_reason, style="red"))
    return table


@cdc.command()
@dsn_option
@table_option
@slot_option
@publication_option
@click.option(
    "--force", is_flag=True, help="Also when a relay streams the slot (its connection is ended)."
)
def drop(dsn: str, table: str, slot: str | None, publication: str | None, force: bool) -> None:
    """Drop the slot (freeing the WAL it holds) and the publication.

    Stop the relays first: events not yet confirmed by the slot are not streamed by a
    new slot (`cdc setup` starts at the end of WAL).
    """
    from outboxkit.cdc.slots import drop as drop_slot

    result = run_guarded(drop_slot, dsn, table, slot=slot, publication=publication, force=force)
    ok(f"slot {result.slot} " + ("dropped" if result.dropped_slot else "did not exist"))
    ok(
        f"publication {result.publication} "
        + ("dropped" if result.dropped_publication else "did not exist")
    )
