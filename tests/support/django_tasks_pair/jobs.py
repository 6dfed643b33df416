"""The same ``@task`` functions on each backend: ``noop`` for the throughput, ``ship`` (an
order's follow-up) for the kill between the COMMIT and an ``on_commit`` callback."""

from __future__ import annotations

try:
    from django.tasks import task  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    from django_tasks import task  # type: ignore[import-not-found,unused-ignore,no-redef]


@task()  # type: ignore[misc]
def noop() -> None:
    pass


@task(backend="db")  # type: ignore[misc]
def noop_db() -> None:
    pass


@task()  # type: ignore[misc]
def ship(order: int) -> int:
    return order


@task(backend="db")  # type: ignore[misc]
def ship_db(order: int) -> int:
    return order
