"""Task handlers of the contrib tests, on ``outboxkit.contrib.django.tasks`` (the worker
command's subprocess loads them with ``--app tests.integration.contrib.django_jobs:tasks``)."""

from pathlib import Path
from typing import Any

from outboxkit.contrib.django import tasks


@tasks.handler("report.write")
def write_report(payload: dict[str, Any]) -> None:
    """Writes the payload's text to its file: the test sees the handler ran, with its payload."""
    Path(payload["file"]).write_text(payload["text"])


@tasks.handler("report.fail", max_attempts=1)
def fail_report(payload: Any) -> None:
    raise RuntimeError("the report service said no")
