"""``outboxkit status | failed | replay | purge``: look at the table and act on its rows."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from outboxkit._redact import mask_headers, redact
from outboxkit.ops.cli.guard import run_guarded
from outboxkit.ops.cli.options import (
    MAX_INT8,
    LibraryOption,
    count_range,
    dsn_option,
    dsn_or_file_options,
    given,
    in_range,
    inbox_option,
    inbox_table_option,
    json_option,
    older_than_option,
    one_of_dsn_or_file,
    parse_duration,
    table_option,
    tasks_table_option,
)
from outboxkit.ops.cli.output import console, fail, id_column, jsonable, ok


def _first_line(error: str | None, limit: int = 500) -> str:
    """An error's first line, as tables show it (the whole one: `failed show` has the rest)."""
    return (str(error or "").splitlines() or [""])[0][:limit]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


@click.command()
@dsn_or_file_options(
    "Each database of this file instead (the file of `relay --dsn-file`): its pending,"
    " in-flight and failed counts and oldest pending age, or why it cannot be read."
)
@table_option
@tasks_table_option(
    "With --dsn-file: the task table whose figures are shown for each database that has it."
)
@json_option("One JSON object, for programs.")
def status(
    dsn: str | None, dsn_file: str | None, table: str, tasks_table: str, as_json: bool
) -> None:
    """Pending, in-flight, failed and published counts, and the oldest pending age.

    With --json prints one object with the keys pending, in_flight, failed,
    published, oldest_pending_age_s, topics (a list of the same per topic) and
    blocked_keys (ordered mode: keys stopped behind a dead-lettered head event, each
    with the head's id, event_id, topic, event_type, attempts, last_error, created_at
    and the count of events waiting behind it; empty on an unordered table).

    With --dsn-file: one row per database; --json prints {"databases": [{name, line,
    pending, in_flight, failed, oldest_pending_age_s, owner, tasks, error}], "bad_lines":
    [{line, error}]}. A database that cannot be read has its error (and null counts); the
    exit code is then 1, as when a line is skipped. tasks: its task table's {queued,
    scheduled, running, failed, oldest_queued_age_s, owner}, or null without one (a
    database with a task table and no outbox table has null outbox counts, no error).
    """
    from outboxkit.admin import admin_for

    one_of_dsn_or_file(dsn, dsn_file)
    if dsn_file is not None:
        from outboxkit.ops.cli.fleet import fleet_status

        code = fleet_status(dsn_file, table, as_json=as_json, age=_age, tasks_table=tasks_table)
        sys.exit(code)
    assert dsn is not None

    admin = admin_for(dsn)
    report = run_guarded(admin.status, dsn, table)
    blocked = run_guarded(admin.blocked_keys, dsn, table=table, limit=_BLOCKED_KEYS_SHOWN)
    for head in blocked:
        head["last_error"] = redact(head["last_error"] or "")
    if as_json:
        shown = [{k: jsonable(v) for k, v in head.items()} for head in blocked]
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
    if not report.published:
        console.print(_PUBLISHED_NOTE, soft_wrap=True)
    if blocked:
        _print_blocked_keys(table, blocked)
    if report.failed:
        console.print(
            Text.assemble(("dead letters present:", "yellow"), " see `outboxkit failed list`")
        )
    if stray := run_guarded(
        admin.stray_rows, dsn, table
    ):  # a partitioned outbox's default partition
        console.print(
            Text.assemble(
                ("rows outside every partition:", "yellow"),
                f" {stray} in the default partition; see `outboxkit partitions list`",
            )
        )


_BLOCKED_KEYS_SHOWN = 100
# "published 0" right after a relay published read as "nothing went out": with the default
# retention (delete) a published row is gone, and only the relay counts it.
_PUBLISHED_NOTE = Text.assemble(
    ("published", "bold"),
    " counts rows kept by --retention keep; with the default retention (delete) a published"
    " event leaves the table, and the relay's /metrics count it"
    " (outboxkit_events_published_total)",
)


def _print_blocked_keys(table: str, blocked: list[dict[str, Any]]) -> None:
    """Ordered mode: each key stopped behind its dead-lettered head event, with its error."""
    more = "+" if len(blocked) >= _BLOCKED_KEYS_SHOWN else ""
    tbl = Table(
        title=Text(
            f"{table}: {len(blocked)}{more} blocked key(s), each behind a failed head event"
        ),
        title_justify="left",
    )
    id_column(tbl, "key")
    id_column(tbl, "head id", justify="right")
    for col in ("topic", "attempts", "waiting", "head event's error"):
        tbl.add_column(col, justify="right" if col in ("attempts", "waiting") else "left")
    for head in blocked:
        tbl.add_row(
            Text(str(head["key"])),
            str(head["id"]),
            Text(str(head["topic"])),
            str(head["attempts"]),
            str(head["waiting"]),
            Text(_first_line(head["last_error"]) or "-", style="red"),
        )
    console.print(tbl)
    console.print(
        Text.assemble(
            ("blocked keys:", "yellow"),
            " fix the cause, then `outboxkit replay --id <head id>` (or `outboxkit failed"
            " discard --id <head id>`) to let the key go on",
        )
    )


# -- failed / replay / purge --------------------------------------------------------


@click.group()
def failed() -> None:
    """Inspect dead-lettered events (status failed)."""


@failed.command("list")
@dsn_option
@table_option
@click.option("--topic", default=None, help="Only this topic.")
@click.option(
    "--limit",
    callback=count_range,
    cls=LibraryOption,
    default_from=("outboxkit.backends.postgres.admin:list_failed", "limit"),
    type=click.IntRange(min=1),
    help="List at most this many events (the oldest first).",
)
@json_option("A JSON array, for programs.")
def failed_list(dsn: str, table: str, topic: str | None, limit: int | None, as_json: bool) -> None:
    """List dead-lettered events, oldest first."""
    from outboxkit.admin import admin_for

    admin = admin_for(dsn)

    rows = run_guarded(admin.list_failed, dsn, table, topic=topic, **given(limit=limit))
    if as_json:
        click.echo(json.dumps([{k: jsonable(v) for k, v in r.items()} for r in rows]))
        return
    if not rows:
        console.print(Text("no failed events", style="green"))
        return
    tbl = Table(title=Text(f"failed events in {table}"), title_justify="left")
    id_column(tbl, "id", justify="right")
    id_column(tbl, "event id")
    for col in ("topic", "type", "attempts", "last error"):
        tbl.add_column(col, overflow="fold", justify="right" if col == "attempts" else "left")
    for r in rows:
        tbl.add_row(
            str(r["id"]),
            str(r["event_id"]),
            Text(r["topic"]),
            Text(r["event_type"]),
            str(r["attempts"]),
            Text(_first_line(r["last_error"])),
        )
    console.print(tbl)
    console.print("replay with: outboxkit replay --id ID | --topic T | --all-failed")
    console.print("or delete for good: outboxkit failed discard --id ID | --topic T | --all-failed")


@failed.command("show")
@click.argument("ref")
@dsn_option
@table_option
@json_option("One JSON object, for programs.")
def failed_show(ref: str, dsn: str, table: str, as_json: bool) -> None:
    """Show one event (by row id or event id), headers and payload included."""
    from outboxkit.admin import admin_for

    admin = admin_for(dsn)

    row = run_guarded(admin.get_event, dsn, ref, table)
    if row is None:
        fail(f"no event {ref!r} in {table}", 1)
    if row.get("headers"):  # masked as the dashboard and the admin show them
        row["headers"] = mask_headers(row["headers"])
    if row.get("last_error"):
        row["last_error"] = redact(str(row["last_error"]))
    data = {k: jsonable(v) for k, v in row.items()}
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


def _event_refs(_ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> Any:
    """A click callback: each --id as a row id (in bigint's range) or an event id (UUID)."""
    from outboxkit.maintenance.report import parse_event_ref

    in_range(1, MAX_INT8)(_ctx, param, tuple(int(v) for v in values if v.strip().isdigit()))
    try:
        return [parse_event_ref(v) for v in values]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


_ID_HELP = "Row id or event id (UUID), as `failed list` shows them (repeatable)."


def _nothing_matched(verb: str, table: str, ids: list[Any], topic: str | None) -> None:
    """Say that no failed event matched and exit 1: a typo must not read as success."""
    if ids:
        what = f"no failed event with id {', '.join(str(i) for i in ids)}"
    elif topic is not None:
        what = f"no failed event of topic {topic!r}"
    else:
        what = "no failed event"
    fail(f"{what} in {table}: nothing to {verb}; see `outboxkit failed list`", 1)


@click.command()
@dsn_option
@table_option
@click.option("--id", "ids", callback=_event_refs, multiple=True, help=_ID_HELP)
@click.option("--topic", default=None, help="Replay every failed event of this topic.")
@click.option("--all-failed", is_flag=True, help="Replay every failed event.")
def replay(dsn: str, table: str, ids: list[Any], topic: str | None, all_failed: bool) -> None:
    """Put dead-lettered events back in line with a fresh attempt budget.

    Exactly one of --id, --topic or --all-failed. Exits 1 when no failed event matched.
    """
    from outboxkit.admin import admin_for

    admin = admin_for(dsn)

    if sum(bool(x) for x in (ids, topic, all_failed)) != 1:
        fail("say what to replay: --id ID (repeatable), --topic T, or --all-failed", 2)
    n = run_guarded(
        admin.replay, dsn, table, ids=list(ids) or None, topic=topic, all_failed=all_failed
    )
    if n == 0:
        _nothing_matched("replay", table, ids, topic)
    ok(f"{n} event(s) back to pending")


@failed.command("discard")
@dsn_option
@table_option
@click.option("--id", "ids", callback=_event_refs, multiple=True, help=_ID_HELP)
@click.option("--topic", default=None, help="Discard every failed event of this topic.")
@click.option("--all-failed", is_flag=True, help="Discard every failed event.")
@click.option("--yes", is_flag=True, help="Do not ask before discarding a topic's or all.")
def failed_discard(
    dsn: str, table: str, ids: list[Any], topic: str | None, all_failed: bool, yes: bool
) -> None:
    """Delete dead-lettered events for good (ordered mode: lets a blocked key go on).

    Exactly one of --id, --topic or --all-failed; the last two ask first unless --yes.
    Only events in status failed are deleted. Exits 1 when none matched.
    """
    from outboxkit.admin import admin_for

    admin = admin_for(dsn)

    if sum(bool(x) for x in (ids, topic, all_failed)) != 1:
        fail("say what to discard: --id ID (repeatable), --topic T, or --all-failed", 2)
    if not ids and not yes:
        what = f"every failed event of topic {topic!r}" if topic else "every failed event"
        if not click.confirm(f"delete {what} in {table} for good?", err=True):
            fail("nothing discarded", 1)
    n = run_guarded(
        admin.discard, dsn, table, ids=list(ids) or None, topic=topic, all_failed=all_failed
    )
    if n == 0:
        _nothing_matched("discard", table, ids, topic)
    ok(f"discarded {n} failed event(s)")


@click.command()
@dsn_option
@table_option
@older_than_option("Age of published rows to delete, e.g. 7d, 12h, 1h30m.")
@click.option(
    "--batch-size",
    callback=count_range,
    cls=LibraryOption,
    default_from=("outboxkit.backends.postgres.admin:purge", "batch_size"),
    type=click.IntRange(min=1),
    help="Rows per transaction.",
)
@json_option('Print {"deleted": N} only, for programs.')
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

    from outboxkit.admin import admin_for

    admin = admin_for(dsn)
    age = parse_duration(older_than)

    def run_purge(**kw: Any) -> Any:
        kw.update(given(batch_size=batch_size))
        if inbox:
            return run_guarded(
                admin.purge_inbox,
                dsn,
                older_than=age,
                table=inbox_table,
                consumer=consumer,
                **kw,
            )
        return run_guarded(admin.purge, dsn, table, older_than=age, **kw)

    if as_json:
        click.echo(json.dumps({"deleted": run_purge()}))
        return
    if inbox:
        total = run_guarded(
            admin.count_inbox_purgeable,
            dsn,
            older_than=age,
            table=inbox_table,
            consumer=consumer,
        )
    else:
        total = run_guarded(admin.count_purgeable, dsn, table, age)
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
    ok(f"deleted {n} {what} older than {older_than}")
