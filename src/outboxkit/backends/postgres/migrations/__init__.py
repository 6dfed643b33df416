"""The schema as versioned ``.sql`` files: one directory per kind of table, one file per version.

``outbox/`` (``0001_outbox.sql``, ``0002_occurred_at.sql``, ...), ``partitioned/`` (its own
version 1, then the outbox's later files), ``ordered/`` (ordered mode, added to an outbox) and
``inbox/``. ``outboxkit migrate`` applies a kind's files in version order and records the
version; a Django migration, an Alembic revision or a DBA's tool applies the same files
through :func:`outboxkit.backends.postgres.migrate.migration_statements`.

A file is a header comment (what the version does and why; ended by a blank line, never
rendered), then its statements, each ending with ``;`` at the end of a line. Names and values
are ``{placeholders}`` in :meth:`psycopg.sql.SQL.format` syntax (``{{`` and ``}}`` are literal
braces), filled with :class:`psycopg.sql.Identifier` or :class:`psycopg.sql.Literal`, never
with raw text. A released file never changes: a schema change is a new file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal, get_args

from psycopg import sql

Kind = Literal["outbox", "partitioned", "ordered", "inbox", "tasks"]
KINDS: tuple[Kind, ...] = get_args(Kind)
_FILE = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class MigrationFile:
    """One schema version of one kind of table, as its file holds it."""

    kind: Kind  # the directory it was read from
    version: int
    name: str  # the file's name, e.g. "0002_occurred_at.sql"
    description: str  # the header comment, without its "-- "
    template: str  # the statements, placeholders unfilled

    def render(self, slots: Mapping[str, sql.Composable]) -> str:
        """The statements as one script, placeholders filled (quoted identifiers, literals)."""
        return sql.SQL(self.template).format(**slots).as_string(None)

    def statements(self, slots: Mapping[str, sql.Composable]) -> list[str]:
        """The rendered statements one by one, each with the comments before it."""
        return split_statements(self.render(slots))


def split_statements(script: str) -> list[str]:
    """``script`` cut after each line that ends with ``;`` (the files' one rule)."""
    found: list[str] = []
    lines: list[str] = []
    for line in script.splitlines():
        lines.append(line)
        if line.rstrip().endswith(";") and not line.lstrip().startswith("--"):
            found.append("\n".join(lines).strip())
            lines = []
    if "\n".join(lines).strip():
        # What follows the last ";" would be lost by a tool applying statements one by one.
        raise ValueError(f"SQL after the last statement: {' '.join(lines).strip()[:80]!r}")
    return found


@cache
def migration_files(kind: Kind) -> tuple[MigrationFile, ...]:
    """Every version of ``kind`` in order. A partitioned outbox has its own version 1 and
    shares the plain outbox's later versions."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of table {kind!r}: one of {', '.join(KINDS)}")
    own = _read(kind)
    if kind == "partitioned":
        return own + tuple(f for f in _read("outbox") if f.version > len(own))
    return own


def _read(kind: Kind) -> tuple[MigrationFile, ...]:
    found = []
    for entry in resources.files(__name__).joinpath(kind).iterdir():
        if not entry.name.endswith(".sql"):
            continue
        m = _FILE.match(entry.name)
        if m is None:
            raise RuntimeError(f"migration file {kind}/{entry.name}: name it NNNN_name.sql")
        description, template = _parts(entry.read_text(encoding="utf-8"))
        found.append(MigrationFile(kind, int(m["version"]), entry.name, description, template))
    found.sort(key=lambda f: f.version)
    if [f.version for f in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"migration files of {kind}: versions must run 1, 2, ... without gaps")
    return tuple(found)


def _parts(text: str) -> tuple[str, str]:
    """(header comment, statements) of a file; the header ends at the first blank line."""
    head, _blank, body = text.partition("\n\n")
    lines = head.splitlines()
    if not body.strip() or not all(line.startswith("--") for line in lines):
        raise RuntimeError("a migration file starts with a comment block and a blank line")
    return "\n".join(line[2:].strip() for line in lines), body.strip() + "\n"
