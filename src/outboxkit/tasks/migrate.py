"""``migrate_tasks``: the task table on whichever database the URL names.

The public name predates MariaDB's task mode and was PostgreSQL's function re-exported;
it now asks the backend chosen from the URL (``backends.backend_for``), as ``outboxkit
migrate --tasks`` does, so the two cannot disagree about what a database gets.
"""

from __future__ import annotations

from outboxkit.backends import backend_for
from outboxkit.backends.ports import Migrated
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE


def migrate_tasks(conninfo: str, *, table: str = DEFAULT_TASKS_TABLE) -> Migrated:
    """Create the task table, its indexes and side tables if missing (idempotent).

    ``conninfo``: a PostgreSQL DSN or a ``mysql://``/``mariadb://`` URL. The result's
    ``describe()`` is the line ``outboxkit migrate --tasks`` prints; on PostgreSQL it is the
    ``MigrationResult`` this function always returned there.
    """
    backend = backend_for(conninfo)
    backend.refuse("tasks")
    return backend.migrate(conninfo, "tasks", table)
