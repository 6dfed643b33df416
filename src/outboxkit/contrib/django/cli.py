"""``manage.py outboxkit_<command>``: the ``outboxkit`` command, connected through DATABASES.

The options are the ``outboxkit`` command's own (``manage.py outboxkit_relay --help``
lists them): this runs that command in-process with ``--dsn`` made from Django's
``DATABASES[--database]`` (the password stays out of ``ps``) and ``--table`` from
``settings.OUTBOXKIT``, so nothing of the command is written twice.
"""

from __future__ import annotations

import argparse
from typing import Any, cast

import click
from django.core.management.base import BaseCommand, CommandError, CommandParser

from outboxkit.contrib.django import conf
from outboxkit.contrib.django.db import dsn_for


class OutboxkitCommand(BaseCommand):
    """A management command that hands its arguments to ``outboxkit <command>``."""

    #: The ``outboxkit`` subcommand.
    command: str

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, add_help=False, **kwargs)
        parse_known = parser.parse_known_args

        def parse_args(args: Any = None, namespace: Any = None) -> argparse.Namespace:
            # Django's options (--database, --settings, ...) here, the rest to the command.
            ns, rest = parse_known(args, namespace)
            ns.args = [*(getattr(ns, "args", None) or ()), *rest]
            return cast(argparse.Namespace, ns)

        parser.parse_args = parse_args
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            default="default",
            help="The DATABASES entry whose outbox to use [default: default].",
        )
        parser.add_argument("-h", "--help", dest="args", action="append_const", const="--help")

    def command_args(self, args: list[str]) -> list[str]:
        """The command's arguments after ``--dsn``: the outbox's ``--table``, then the user's."""
        return ["--table", conf.get().TABLE, *args]

    def handle(self, *args: str, **options: Any) -> None:
        from outboxkit.ops.cli import main

        if any(a == "--dsn" or a.startswith("--dsn=") for a in args):
            raise CommandError(
                "the connection comes from settings.DATABASES: pass --database NAME, not --dsn"
            )
        try:
            dsn = dsn_for(options["database"])
        except Exception as exc:  # a missing alias, another vendor: one line, no traceback
            raise CommandError(str(exc)) from None
        argv = [self.command, "--dsn", dsn, *self.command_args(list(args))]

        try:
            main.main(
                args=argv,
                prog_name=f"manage.py outboxkit_{self.command}",
                standalone_mode=False,
            )
        except click.ClickException as exc:
            raise CommandError(exc.format_message()) from None
        except click.exceptions.Abort:
            raise CommandError("aborted") from None
