"""The ``outboxkit`` group: every command group's module adds its commands here."""

from __future__ import annotations

from typing import Any

import click

from outboxkit._version import __version__
from outboxkit.errors import OutboxkitError, missing_extra
from outboxkit.ops.cli import (
    admin,
    cdc,
    dashboard,
    demo,
    dev,
    migrate,
    partitions,
    relay,
    tasks,
    worker,
)
from outboxkit.ops.cli.output import fail


class _Commands(click.Group):
    """A command that needs a library this install lacks says which extra brings it.

    An outboxkit error no command caught (an option's check, such as --dsn's) is one line
    too, never a traceback.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OutboxkitError as exc:
            fail(str(exc), 2)
        except ModuleNotFoundError as exc:
            if (exc.name or "outboxkit").startswith("outboxkit"):
                raise  # a broken install or a bug: the traceback is what helps
            fail(str(missing_extra(exc, f"`outboxkit {ctx.invoked_subcommand}`")), 2)


@click.group(
    cls=_Commands,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
# The version's one place (pyproject's [tool.hatch.version] reads it too), not the installed
# metadata: a source tree on PYTHONPATH over an older install reports what it runs.
@click.version_option(__version__, "--version", "-V", prog_name="outboxkit")
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


for command in (
    migrate.migrate,
    relay.relay,
    admin.status,
    admin.failed,
    admin.replay,
    admin.purge,
    dashboard.dashboard,
    demo.demo,
    dev.dev,
    partitions.partitions,
    cdc.cdc,
    worker.worker,
    tasks.tasks,
):
    main.add_command(command)
