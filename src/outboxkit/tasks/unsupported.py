"""Task mode where the database has no task store: refused where it starts, in one line.

The reason is the backend's own (``Backend.cannot["tasks"]``, backends/mariadb/backend.py),
said once for every entry point (enqueue, the Worker, `outboxkit worker`, `outboxkit tasks
…`, `outboxkit migrate --tasks`, the dashboard); these two functions only ask the backend
picked from a URL or a connection.
"""

from __future__ import annotations

from typing import Any

from outboxkit.backends import backend_for, backend_of


def refuse_url(dsn: str) -> None:
    """ConfigurationError naming what is missing, if ``dsn``'s database has no task store."""
    backend_for(dsn).refuse("tasks")


def refuse_connection(conn: Any) -> None:
    """The same for an open connection (a driver's, or SQLAlchemy's by its dialect)."""
    backend_of(conn).refuse("tasks")


def missing(dsn: str) -> str | None:
    """Why ``dsn``'s database cannot run task mode, or None."""
    return backend_for(dsn).cannot.get("tasks")
