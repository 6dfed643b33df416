"""``manage.py outboxkit_worker [--app module:attribute] [options of outboxkit worker]``."""

from __future__ import annotations

import importlib

from django.core.management.base import CommandError
from django.utils.module_loading import autodiscover_modules

from outboxkit.contrib.django import task_mode
from outboxkit.contrib.django.cli import OutboxkitCommand
from outboxkit.tasks import Tasks

_APP = "outboxkit.contrib.django.task_mode:worker_app"


class Command(OutboxkitCommand):
    help = (
        "Run task mode's handlers: `outboxkit worker` on the connection of"
        " DATABASES[--database], the handlers of outboxkit.contrib.django.tasks registered by"
        " each app's tasks module (or --app module:attribute) (--help lists its options)."
    )
    command = "worker"

    def command_args(self, args: list[str]) -> list[str]:
        if "--help" in args:
            return args
        rest: list[str] = []
        spec: str | None = None
        items = iter(args)
        for arg in items:
            if arg == "--app":
                spec = next(items, "")
            elif arg.startswith("--app="):
                spec = arg.removeprefix("--app=")
            else:
                rest.append(arg)
        task_mode.worker_app = _load(spec)
        return ["--app", _APP, *rest]


def _load(spec: str | None) -> Tasks:
    """The Tasks to run: ``--app``'s (a DjangoTasks or a Tasks), else the app's ``tasks``
    after importing every installed app's ``tasks`` module (where handlers register)."""
    from outboxkit.contrib.django import DjangoTasks, tasks

    if spec is None:
        autodiscover_modules("tasks")
        return tasks.tasks
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CommandError(f"--app takes module:attribute (e.g. shop.jobs:tasks), got {spec!r}")
    try:
        found = getattr(importlib.import_module(module_name), attribute, None)
    except ImportError as exc:
        raise CommandError(f"--app {spec}: cannot import {module_name!r} ({exc})") from None
    if isinstance(found, DjangoTasks):
        return found.tasks
    if isinstance(found, Tasks):
        return found
    raise CommandError(
        f"--app {spec}: {module_name}.{attribute} is not outboxkit.contrib.django.tasks"
        " nor an outboxkit.tasks.Tasks"
    )
