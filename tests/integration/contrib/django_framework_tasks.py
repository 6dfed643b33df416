"""Django Tasks framework ``@task`` functions run by outboxkit's backend in the tests."""

from __future__ import annotations

from typing import Any

try:
    from django.tasks import task  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    from django_tasks import task  # type: ignore[import-not-found,unused-ignore,no-redef]


class ReportFailed(Exception):
    pass


@task()  # type: ignore[misc]
def add(a: int, b: int) -> int:
    return a + b


@task()  # type: ignore[misc]
async def add_async(a: int, b: int) -> int:
    return a + b


@task(takes_context=True)  # type: ignore[misc]
def attempt(context: Any) -> int:
    return int(context.attempt)


@task()  # type: ignore[misc]
def fail() -> None:
    raise ReportFailed("the report failed")
