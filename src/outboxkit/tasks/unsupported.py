"""What task mode cannot do on a database: refused where it starts, in one line.

The reason is the backend's own (``Backend.cannot["tasks"]``, or a part of task mode such as
``"task_events"``: backends/mariadb/backend.py), said once for every entry point (`outboxkit
worker`, `outboxkit tasks …`, the dashboard's Tasks page); this only asks the backend picked
from a URL.
"""

from __future__ import annotations

from outboxkit.backends import Feature, backend_for


def missing(dsn: str, feature: Feature = "tasks") -> str | None:
    """Why ``dsn``'s database cannot run task mode (or ``feature`` of it), or None."""
    backend = backend_for(dsn)
    return backend.cannot.get("tasks") or backend.cannot.get(feature)
