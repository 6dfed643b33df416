"""``outboxkit migrate``: create or upgrade the outbox (or inbox) table, or print its DDL."""

from __future__ import annotations

from typing import Literal

import click

from outboxkit.errors import ConfigurationError
from outboxkit.ops.cli.guard import run_guarded
from outboxkit.ops.cli.options import (
    dsn_option_of,
    given,
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
      outboxkit migrate --partition-by day --dsn postgresql://app@db/shop
      outboxkit migrate --ordered --partitions 64 --dsn postgresql://app@db/shop
      outboxkit migrate --dsn mysql://app@db/shop   (MariaDB 10.6+ / MySQL 8)
      outboxkit migrate --ordered --dsn mysql://app@db/shop
    """
    from outboxkit.backends.mariadb.sql import is_mysql_url

    _refuse_ignored(tasks=tasks, inbox=inbox)
    if dsn and is_mysql_url(dsn):  # (--print-sql too: MariaDB's DDL)
        _migrate_mariadb(
            dsn,
            inbox_table if inbox else table,
            inbox,
            print_sql,
            tasks or partition_by is not None,
            tasks=tasks,
            ordered=ordered,
            partitions=partitions,
            repartition=repartition,
        )
        return
    from outboxkit.backends.postgres.migrate import migrate as run_migrate
    from outboxkit.backends.postgres.postgres import Statements

    if inbox:
        _migrate_inbox(dsn, inbox_table, print_sql)
        return
    if tasks:
        _migrate_tasks(dsn, tasks_table, print_sql)
        return
    if (partitions is not None or repartition) and not ordered:
        fail("--partitions and --repartition apply to ordered mode: add --ordered", 2)
    ordered_options = given(partitions=partitions) | ({"repartition": True} if repartition else {})
    if print_sql and ordered:
        from outboxkit.backends.postgres.ordered_sql import DEFAULT_PARTITIONS, OrderedStatements

        try:
            stmts = OrderedStatements(table)
            click.echo(stmts.ddl(), nl=False)
            if repartition:
                click.echo(stmts.repartition_ddl(), nl=False)
            click.echo(stmts.ordered_ddl(partitions or DEFAULT_PARTITIONS), nl=False)
        except ConfigurationError as exc:
            fail(str(exc), 2)
        return
    if print_sql:
        try:
            if partition_by is not None:
                from outboxkit.backends.postgres.partitions import partitioned_script

                click.echo(partitioned_script(table, partition_by), nl=False)
                return
            click.echo(Statements(table).ddl(), nl=False)
        except ConfigurationError as exc:
            fail(str(exc), 2)
        return
    if not dsn:
        fail("give --dsn (or set OUTBOXKIT_DSN), or use --print-sql to get the DDL", 2)
    if ordered:
        ordered_options["ordered"] = True
    result = run_guarded(
        run_migrate, dsn, table=table, **given(partition_by=partition_by), **ordered_options
    )
    ok(result.describe())


def _migrate_inbox(dsn: str | None, inbox_table: str, print_sql: bool) -> None:
    from outboxkit.backends.postgres.inbox_sql import InboxStatements
    from outboxkit.backends.postgres.migrate import migrate_inbox

    if print_sql:
        try:
            click.echo(InboxStatements(inbox_table).ddl(), nl=False)
        except ConfigurationError as exc:
            fail(str(exc), 2)
        return
    if not dsn:
        fail("give --dsn (or set OUTBOXKIT_DSN), or use --print-sql to get the DDL", 2)
    result = run_guarded(migrate_inbox, dsn, table=inbox_table)
    ok(result.describe())


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


def _migrate_tasks(dsn: str | None, tasks_table: str, print_sql: bool) -> None:
    from outboxkit.backends.postgres.migrate import migrate_tasks
    from outboxkit.backends.postgres.tasks_sql import TaskStatements

    if print_sql:
        try:
            click.echo(TaskStatements(tasks_table).ddl(), nl=False)
        except ConfigurationError as exc:
            fail(str(exc), 2)
        return
    if not dsn:
        fail("give --dsn (or set OUTBOXKIT_DSN), or use --print-sql to get the DDL", 2)
    result = run_guarded(migrate_tasks, dsn, table=tasks_table)
    ok(result.describe())


def _migrate_mariadb(
    dsn: str | None,
    table: str,
    inbox: bool,
    print_sql: bool,
    unsupported: bool,
    *,
    tasks: bool = False,
    ordered: bool = False,
    partitions: int | None = None,
    repartition: bool = False,
) -> None:
    """The MariaDB/MySQL backend: the outbox (ordered or not) or the inbox (tasks and
    partitioned tables are PostgreSQL's only, for now)."""
    from outboxkit.backends.mariadb import migrate as mariadb
    from outboxkit.backends.mariadb.sql import DEFAULT_PARTITIONS

    if tasks:
        from outboxkit.tasks.unsupported import MISSING

        fail(MISSING, 2)
    if unsupported:
        fail(
            "on MariaDB/MySQL, migrate creates the outbox (--ordered too) and the inbox only:"
            " --tasks and --partition-by need PostgreSQL",
            2,
        )
    if (partitions is not None or repartition) and not ordered:
        fail("--partitions and --repartition apply to ordered mode: add --ordered", 2)
    kind: Literal["outbox", "inbox", "ordered"] = (
        "inbox" if inbox else "ordered" if ordered else "outbox"
    )
    count = DEFAULT_PARTITIONS if partitions is None else partitions
    if print_sql:
        try:
            click.echo(mariadb.ddl(kind, table, count, repartition=repartition), nl=False)
        except ConfigurationError as exc:
            fail(str(exc), 2)
        return
    assert dsn is not None
    options = given(partitions=partitions) | ({"repartition": True} if repartition else {})
    result = run_guarded(mariadb.migrate, dsn, table=table, kind=kind, **options)
    ok(result.describe())
