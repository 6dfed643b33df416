"""``outboxkit demo``: the dual-write problem and the outbox closing it, under real faults."""

from __future__ import annotations

import sys

import click

from outboxkit.ops.cli.guard import run_guarded
from outboxkit.ops.cli.options import (
    DEMO,
    LibraryOption,
    count_range,
    dsn_option_of,
    given,
    json_option,
    seconds_range,
)


@click.command()
@click.option(
    "--orders",
    callback=count_range,
    cls=LibraryOption,
    default_from=(DEMO, "orders"),
    type=int,
    help="Orders to place per path.",
)
@click.option(
    "--duration",
    callback=seconds_range,
    cls=LibraryOption,
    default_from=(DEMO, "duration"),
    type=float,
    help="Seconds over which orders are placed.",
)
@click.option(
    "--broker",
    default=None,
    help="nats:// URL of a NATS JetStream you already run [default: an embedded one].",
)
@dsn_option_of(required=False, help_text="PostgreSQL to use [default: an embedded one].")
@json_option("Print the result table as JSON.")
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

    ok = run_guarded(
        run_demo,
        broker=broker,
        dsn=dsn,
        as_json=as_json,
        source=source,
        **given(orders=orders, duration=duration),
    )
    sys.exit(0 if ok else 1)
