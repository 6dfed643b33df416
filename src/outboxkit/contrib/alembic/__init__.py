"""outboxkit for Alembic: the outbox, inbox and task tables from ``outboxkit migrate``'s files.

In a revision (``alembic revision -m "outbox"``)::

    from outboxkit.contrib import alembic as outboxkit_alembic

    def upgrade():
        outboxkit_alembic.upgrade(op, to_version=2)              # the outbox, versions 1-2
        outboxkit_alembic.upgrade(op, kind="inbox", to_version=1)

    def downgrade():
        outboxkit_alembic.downgrade(op, kind="inbox", from_version=1)
        outboxkit_alembic.downgrade(op, from_version=2)

Each version runs the statements ``outboxkit migrate`` runs on the migrated database, and
keeps its version record as it does: either tool can run first, the other then has nothing
to do. The database's backend says what they are: on PostgreSQL its versioned SQL files,
behind ``migrate``'s lock (the record never lowered); on MariaDB/MySQL its migration files,
each at the PostgreSQL version it was written beside (``tool_migrations.PG_VERSION``: the
first at version 1; most later versions have nothing to do there).
The versions are PostgreSQL's numbers on both, so one revision serves either database.
Pin ``to_version`` in the revision; when outboxkit adds a schema version, a new revision
applies it (``upgrade(op, from_version=2, to_version=3)``). ``latest(kind)`` says which
versions this outboxkit knows.

In ``env.py``, ``include_name=outboxkit_alembic.include_name`` (or ``include_object``) in
``context.configure(...)`` keeps autogenerate and ``alembic check`` off these tables, which
are in no SQLAlchemy metadata.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from alembic.operations import Operations
from sqlalchemy import text

from outboxkit.backends import backend_for, backend_of
from outboxkit.backends.ports import Backend, MigrationKind, Statement
from outboxkit.backends.postgres.inbox_sql import DEFAULT_INBOX_TABLE
from outboxkit.backends.postgres.migrations import Kind
from outboxkit.backends.postgres.postgres import DEFAULT_TABLE, VERSIONS_TABLE, parse_table
from outboxkit.backends.postgres.tool_migrations import versions
from outboxkit.queue.tasks import DEFAULT_TASKS_TABLE

__all__ = ["OutboxTables", "downgrade", "include_name", "include_object", "latest", "upgrade"]


def latest(kind: Kind = "outbox") -> int:
    """The newest schema version of ``kind`` this outboxkit has."""
    return versions(kind)[-1]


def _backend(op: Operations) -> Backend:
    """The migrated database's backend: its connection's, or offline (``--sql``) its dialect's."""
    context = op.get_context()
    if context.bind is not None:
        return backend_of(context.bind)
    return backend_for(f"{context.dialect.name}://")


#: The kinds another tool applies (ordered mode and time partitions are `migrate`'s only).
_TOOL_KINDS: dict[str, MigrationKind] = {"outbox": "outbox", "inbox": "inbox", "tasks": "tasks"}


def _checked(kind: Kind, table: str | None, low: int, high: int) -> tuple[MigrationKind, str]:
    """``kind`` as the backends take it and ``table`` (or ``kind``'s default), once ``kind``
    and the range ``low < high`` are ones this outboxkit has: a wrong one fails before any
    statement."""
    tool_kind = _TOOL_KINDS.get(kind)
    if tool_kind is None:
        raise ValueError(
            f"kind {kind!r}: the Alembic helper applies 'outbox', 'inbox' or 'tasks'; ordered"
            " mode and time partitions come from `outboxkit migrate --ordered / --partition-by`"
        )
    known = versions(kind)
    if not 0 <= low < high <= known[-1]:
        raise ValueError(
            f"{kind} versions run 1 to {known[-1]} in this outboxkit: got from/to versions"
            f" {low} and {high}"
        )
    default = {"inbox": DEFAULT_INBOX_TABLE, "tasks": DEFAULT_TASKS_TABLE}.get(kind, DEFAULT_TABLE)
    return tool_kind, default if table is None else table


def _execute(op: Operations, statement: Statement) -> None:
    """One statement through ``op.execute`` (so ``--sql`` prints it), its ``%s`` parameters
    as bound values (rendered as literals offline)."""
    sql, params = (statement, ()) if isinstance(statement, str) else statement
    # text() would read ":name" as a bind parameter (also inside comments): escape them.
    sql = sql.replace(":", r"\:")
    if not params:
        op.execute(text(sql))
        return
    parts = sql.split("%s")
    if len(parts) != len(params) + 1:
        raise ValueError(f"{len(params)} parameters for {len(parts) - 1} placeholders: {sql}")
    names = [f"p{i}" for i in range(len(params))]
    sql = parts[0] + "".join(f":{name}{part}" for name, part in zip(names, parts[1:], strict=True))
    op.execute(text(sql).bindparams(**dict(zip(names, params, strict=True))))


def upgrade(
    op: Operations,
    *,
    to_version: int,
    from_version: int = 0,
    table: str | None = None,
    kind: Kind = "outbox",
) -> None:
    """Apply ``kind``'s versions ``from_version + 1`` to ``to_version`` to ``table``."""
    tool_kind, name = _checked(kind, table, from_version, to_version)
    backend = _backend(op)
    for version in range(from_version + 1, to_version + 1):
        for statement in backend.tool_migration(tool_kind, name, version)[0]:
            _execute(op, statement)


def downgrade(
    op: Operations,
    *,
    from_version: int,
    to_version: int = 0,
    table: str | None = None,
    kind: Kind = "outbox",
) -> None:
    """Undo ``kind``'s versions ``from_version`` down to ``to_version + 1`` (0: drop it)."""
    tool_kind, name = _checked(kind, table, to_version, from_version)
    backend = _backend(op)
    for version in range(from_version, to_version, -1):
        for statement in backend.tool_migration(tool_kind, name, version)[1]:
            _execute(op, statement)


class OutboxTables:
    """Autogenerate hooks that leave outboxkit's tables alone (they are in no metadata).

    ``tables``: the outbox and inbox tables (``schema.table`` allowed); the version records
    and an ordered outbox's ``<table>_partitions`` / ``<table>_relays`` come with them.
    """

    def __init__(self, tables: Iterable[str] = (DEFAULT_TABLE, DEFAULT_INBOX_TABLE)) -> None:
        names: set[tuple[str | None, str]] = set()
        for table in tables:
            schema, name = parse_table(table)
            names |= {(schema, name), (schema, f"{name}_partitions"), (schema, f"{name}_relays")}
            names.add((schema, VERSIONS_TABLE))
        self.names = frozenset(names)

    def _ours(self, schema: str | None, name: str | None) -> bool:
        return (schema, name) in self.names or (schema is None and (None, name) in self.names)

    def include_name(self, name: str | None, type_: str, parent_names: Mapping[str, Any]) -> bool:
        """For ``context.configure(include_name=...)``: False for outboxkit's tables."""
        if type_ == "table":
            return not self._ours(parent_names.get("schema_name"), name)
        return True

    def include_object(
        self, obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
    ) -> bool:
        """For ``context.configure(include_object=...)``: False for outboxkit's tables and
        everything on them (columns, indexes, constraints)."""
        table = obj if type_ == "table" else getattr(obj, "table", None)
        if table is None:
            return True
        return not self._ours(getattr(table, "schema", None), getattr(table, "name", None))


_DEFAULT = OutboxTables()
#: ``include_name`` for the default tables (``outbox``, ``processed_events``).
include_name = _DEFAULT.include_name
#: ``include_object`` for the default tables.
include_object = _DEFAULT.include_object
