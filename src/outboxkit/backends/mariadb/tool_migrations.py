"""``outboxkit migrate``'s MariaDB/MySQL files as another tool's migrations run them (Django's
``outboxkit`` app), numbered as PostgreSQL's versions, which those migrations follow.

MariaDB's version 1 of a kind holds PostgreSQL's versions up to the one it was written
beside: Django's migration of PostgreSQL's version 1 applies it, the later ones have nothing
to do here. Each file's statements are idempotent (``IF NOT EXISTS``, ``INSERT IGNORE``) and
recorded as ``outboxkit migrate`` records them, so either tool finds the other's work done.
"""

from __future__ import annotations

import re

from outboxkit.backends.mariadb import sql
from outboxkit.backends.ports import Statement

#: Per kind: MariaDB's file version -> the PostgreSQL version whose migration applies it.
#: A new MariaDB file gets its line here (a unit test checks that every file has one).
PG_VERSION: dict[sql.Kind, dict[int, int]] = {
    "outbox": {1: 1},
    "inbox": {1: 1},
    "tasks": {1: 1, 2: 9},
}

_CREATED = re.compile(r"^CREATE TABLE IF NOT EXISTS (\S+)", re.IGNORECASE | re.MULTILINE)


def statements(kind: sql.Kind, table: str, version: int) -> tuple[list[Statement], list[Statement]]:
    """The upgrade (the files PostgreSQL's ``version`` brings, recorded) and its reverse
    (their tables dropped, the record forgotten); both empty if it brings none."""
    wanted = PG_VERSION.get(kind, {})
    files = [m for m in sql.migrations(kind) if wanted.get(m.version) == version]
    if not files:
        return [], []
    slots = sql.slots(kind, table)
    up: list[Statement] = [sql.CREATE_VERSIONS]
    created: list[str] = []
    for migration in files:
        for statement in migration.statements(slots):
            up.append(statement)
            found = _CREATED.search(statement)
            if found:
                created.append(found.group(1))
        up.append((sql.RECORD_VERSION, (kind, table, migration.version)))
    # Reversing the first file drops the table: every record of it goes. A later file's
    # reverse drops what it created and forgets its own version only.
    forget: list[Statement] = (
        [(sql.FORGET_VERSIONS, (kind, table))]
        if any(m.version == 1 for m in files)
        else [(sql.FORGET_VERSION, (kind, table, m.version)) for m in files]
    )
    down: list[Statement] = [
        *(f"DROP TABLE IF EXISTS {name}" for name in reversed(created)),
        sql.CREATE_VERSIONS,  # the record table may be gone (a database rebuilt by hand)
        *forget,
    ]
    return up, down
