"""``migrate`` and ``migrate_inbox``: the outbox and the inbox table on whichever database
the URL names.

Both names predate the MariaDB backend and were PostgreSQL's functions re-exported (libpq
refused a ``mysql://`` URL); they now ask the backend chosen from the URL
(``backends.backend_for``), as ``outboxkit migrate`` and ``outboxkit.tasks.migrate_tasks``
do, so the three cannot disagree about what a database gets. What a database cannot do
(``partition_by`` on MariaDB/MySQL) is refused by its backend's ``cannot`` line.
"""

from __future__ import annotations

from outboxkit.backends import backend_for
from outboxkit.backends.ports import Migrated
from outboxkit.backends.postgres.inbox_sql import DEFAULT_INBOX_TABLE
from outboxkit.backends.postgres.postgres import DEFAULT_TABLE
from outboxkit.errors import SchemaError


def migrate(
    conninfo: str,
    *,
    table: str = DEFAULT_TABLE,
    ordered: bool = False,
    partitions: int | None = None,
    repartition: bool = False,
    partition_by: str | None = None,
) -> Migrated:
    """Bring the outbox ``table`` to the current schema version, recreating what is missing.

    ``conninfo``: a PostgreSQL DSN or a ``mysql://``/``mariadb://`` URL. Idempotent; two
    deploys migrating at once serialise (an advisory lock on PostgreSQL, a named lock on
    MariaDB) and the second finds nothing to do. ``ordered=True`` adds ordered mode with
    ``partitions`` key partitions (default 64, or the table's current count); changing the
    count needs ``repartition=True`` with every relay stopped. ``partition_by="day"|"hour"``
    (PostgreSQL only) creates the table range-partitioned by ``created_at``. The result's
    ``describe()`` is the line ``outboxkit migrate`` prints; on PostgreSQL it is the
    ``MigrationResult`` this function always returned there.
    """
    if (partitions is not None or repartition) and not ordered:
        raise SchemaError("partitions and repartition apply to ordered mode: add ordered=True")
    backend = backend_for(conninfo)
    return backend.migrate(
        conninfo,
        "ordered" if ordered else "outbox",
        table,
        partition_by=partition_by,
        partitions=partitions,
        repartition=repartition,
    )


def migrate_inbox(conninfo: str, *, table: str = DEFAULT_INBOX_TABLE) -> Migrated:
    """Create the inbox table and its index if missing (idempotent, serialised by a lock).

    ``conninfo``: a PostgreSQL DSN or a ``mysql://``/``mariadb://`` URL; the result as
    :func:`migrate`'s.
    """
    return backend_for(conninfo).migrate(conninfo, "inbox", table)
