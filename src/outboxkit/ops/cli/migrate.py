"""``outboxkit migrate``: create or upgrade the outbox (or inbox) table, or print its DDL."""

from __future__ import annotations

from typing import Any

import click

from outboxkit.errors import ConfigurationError
from outboxkit.ops.cli.guard import run_guarded
from outboxkit.ops.cli.options import (
    dsn_option_of,
    inbox_option,
    inbox_table_option,
    table_option,
    tasks_table_option,
)
from outboxkit.ops.cli.output import fail, ok


@click.command()
@dsn_option_of(required=False, envvar=True)
@table_option
@click.option("--print-sql", is_flag=True, help="Print the DDL instead of running it.")
@inbox_option
@inbox_table_option
@click.option("--tasks", is_flag=True, help="Create task mode's table (outboxkit worker) instead.")
@tasks_table_option("Task table name (with --tasks), optionally schema-qualified.")
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
@click.option(
    "--fleet",
    is_flag=True,
    help="Also create the fleet lease table (outboxkit_fleet) by which `relay/worker"
    " --dsn-file` processes share the database, so their role needs no CREATE privilege"
    " (without it the first lease check creates the table).",
)
def migrate(
    dsn: str | None,
    table: str,
    print_sql: bool,
    inbox: bool,
    inbox_table: str,
    tasks: bool,
    tasks_table: str,
    partition_by: str | None,
    ordered: bool,
    partitions: int | None,
    repartition: bool,
    fleet: bool,
) -> None:
    """Create or upgrade the outbox table (idempotent; safe from several processes at once).

    With --inbox, create the consumer-side inbox table (processed_events) instead; with
    --tasks, task mode's table (outboxkit_tasks) and its schedules table.

    \b
    Examples:
      outboxkit migrate --dsn postgresql://app@db/shop
      outboxkit migrate --print-sql --table events.outbox > V42__outbox.sql
      outboxkit migrate --inbox --dsn postgresql://app@db/billing
      outboxkit migrate --tasks --dsn postgresql://app@db/shop
      outboxkit migrate --fleet --dsn postgresql://app@db/shop   (for relay --dsn-file)
      outboxkit migrate --partition-by day --dsn postgresql://app@db/shop
      outboxkit migrate --ordered --partitions 64 --dsn postgresql://app@db/shop
      outboxkit migrate --dsn mysql://app@db/shop   (MariaDB 10.6+ / MySQL 8)
      outboxkit migrate --ordered --dsn mysql://app@db/shop
    """
    from outboxkit.backends import backend_for
    from outboxkit.backends.ports import MigrationKind

    _refuse_ignored(tasks=tasks, inbox=inbox)
    if fleet and inbox:
        fail("--fleet applies to the outbox and task tables (a fleet relays or works them)", 2)
    if (partitions is not None or repartition) and not ordered:
        fail("--partitions and --repartition apply to ordered mode: add --ordered", 2)
    kind: MigrationKind = (
        "tasks" if tasks else "inbox" if inbox else "ordered" if ordered else "outbox"
    )
    name = tasks_table if tasks else inbox_table if inbox else table
    # The database's backend migrates it; --print-sql without --dsn prints PostgreSQL's.
    backend = backend_for(dsn or "")
    options: dict[str, Any] = {
        "partition_by": partition_by, "partitions": partitions, "repartition": repartition
    }  # fmt: skip
    if print_sql:
        try:
            click.echo(backend.ddl(kind, name, **options), nl=False)
            if fleet:
                click.echo(backend.fleet_ddl(), nl=False)
        except ConfigurationError as exc:
            fail(str(exc), 2)
        return
    if not dsn:
        fail("give --dsn (or set OUTBOXKIT_DSN), or use --print-sql to get the DDL", 2)
    if fleet:
        run_guarded(backend.refuse, "fleet_leases")  # (before the table's migration)
    result = run_guarded(backend.migrate, dsn, kind, name, **options)
    ok(result.describe())
    if fleet:
        created = run_guarded(backend.migrate_fleet, dsn)
        ok("fleet lease table outboxkit_fleet " + ("created" if created else "in place"))


# What each kind of table takes beside --dsn and --print-sql: a flag given for another
# kind would be ignored (`migrate --tasks --table jobs` created outboxkit_tasks, said so,
# and the worker still failed), so it is refused.
_KIND_OPTIONS = {
    "tasks": {"tasks", "tasks_table"},
    "inbox": {"inbox", "inbox_table"},
    "outbox": {"table", "partition_by", "ordered", "partitions", "repartition"},
}


def _refuse_ignored(*, tasks: bool, inbox: bool) -> None:
    if tasks and inbox:
        fail("give --tasks or --inbox, not both: one table per run", 2)
    kind = "tasks" if tasks else "inbox" if inbox else "outbox"
    ctx = click.get_current_context()
    kinds = set().union(*_KIND_OPTIONS.values())
    for param in ctx.command.params:
        name, flag = param.name or "", param.opts[0]
        given = ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
        if given and name in kinds and name not in _KIND_OPTIONS[kind]:
            hint = {"tasks": "--tasks-table", "inbox": "--inbox-table"}.get(kind)
            fail(
                f"{flag} does not apply to the {kind} table"
                + (f" (name that table with {hint})" if hint and flag == "--table" else "")
                + ": remove it",
                2,
            )
