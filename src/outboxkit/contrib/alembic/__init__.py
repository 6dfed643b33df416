"""outboxkit for Alembic: the outbox and inbox tables from the library's versioned SQL files.

In a revision (``alembic revision -m "outbox"``)::

    from outboxkit.contrib import alembic as outboxkit_alembic

    def upgrade():
        outboxkit_alembic.upgrade(op, to_version=2)              # the outbox, versions 1-2
        outboxkit_alembic.upgrade(op, kind="inbox", to_version=1)

    def downgrade():
        outboxkit_alembic.downgrade(op, kind="inbox", from_version=1)
        outboxkit_alembic.downgrade(op, from_version=2)

Each version runs the statements ``outboxkit migrate`` runs, behind its lock, and keeps its
version record (never lowered): either tool can run first, the other then has nothing to
do. Pin ``to_version`` in the revision; when outboxkit adds a schema version, a new revision
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

from outboxkit.backends import backend_of
from outboxkit.backends.postgres.inbox_sql import DEFAULT_INBOX_TABLE
from outboxkit.backends.postgres.migrations import Kind
from outboxkit.backends.postgres.postgres import DEFAULT_TABLE, VERSIONS_TABLE, parse_table
from outboxkit.backends.postgres.tool_migrations import (
    downgrade_statements,
    upgrade_statements,
    versions,
)

__all__ = ["OutboxTables", "downgrade", "include_name", "include_object", "latest", "upgrade"]


def latest(kind: Kind = "outbox") -> int:
    """The newest schema version of ``kind`` this outboxkit has."""
    return versions(kind)[-1]


def _refuse_other_databases(op: Operations) -> None:
    """The versions are PostgreSQL's SQL: a database whose backend lacks them says so."""
    bind = op.get_context().bind
    if bind is not None:  # offline (--sql): the caller picked the dialect
        backend_of(bind).refuse("alembic")


def _execute(op: Operations, statement: str) -> None:
    # text() would read ":name" as a bind parameter (also inside comments): escape them.
    op.execute(text(statement.replace(":", r"\:")))


def upgrade(
    op: Operations,
    *,
    to_version: int,
    from_version: int = 0,
    table: str | None = None,
    kind: Kind = "outbox",
) -> None:
    """Apply ``kind``'s versions ``from_version + 1`` to ``to_version`` to ``table``."""
    _refuse_other_databases(op)
    known = versions(kind)
    if not 0 <= from_version < to_version <= known[-1]:
        raise ValueError(
            f"{kind} versions run 1 to {known[-1]} in this outboxkit: got from_version"
            f" {from_version}, to_version {to_version}"
        )
    for version in range(from_version + 1, to_version + 1):
        for statement in upgrade_statements(table, kind=kind, version=version):
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
    _refuse_other_databases(op)
    known = versions(kind)
    if not 0 <= to_version < from_version <= known[-1]:
        raise ValueError(
            f"{kind} versions run 1 to {known[-1]} in this outboxkit: got from_version"
            f" {from_version}, to_version {to_version}"
        )
    for version in range(from_version, to_version, -1):
        for statement in downgrade_statements(table, kind=kind, version=version):
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
