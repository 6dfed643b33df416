"""backends/postgres/tool_migrations.py: each version's downgrade undoes exactly that version."""

from __future__ import annotations

import psycopg
import pytest

from outboxkit.backends.postgres.migrations import migration_files
from outboxkit.backends.postgres.tool_migrations import (
    DOWNGRADES,
    TOOL_KINDS,
    downgrade_statements,
    upgrade_statements,
)
from tests.integration.test_migration_files import _apply, _catalog

_CASES = [(kind, f.version) for kind in TOOL_KINDS for f in migration_files(kind)]


def test_every_version_of_every_kind_has_a_downgrade() -> None:
    assert set(DOWNGRADES) == set(_CASES), "add the down statements of the new .sql file"


def _run(dsn: str, statements: list[str]) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for statement in statements:
            conn.execute(statement)


@pytest.mark.parametrize(("kind", "version"), _CASES)
def test_a_version_upgraded_then_downgraded_is_the_version_before(
    empty_db_dsn: str, kind: str, version: int
) -> None:
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA before; CREATE SCHEMA undone")
    table = "processed_events" if kind == "inbox" else "outbox"
    if version > 1:
        _apply(empty_db_dsn, f"before.{table}", kind, through=version - 1)
        _apply(empty_db_dsn, f"undone.{table}", kind, through=version - 1)
    up = list(upgrade_statements(f"undone.{table}", kind=kind, version=version))
    down = list(downgrade_statements(f"undone.{table}", kind=kind, version=version))
    _run(empty_db_dsn, up)
    _run(empty_db_dsn, down)
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        before, undone = _catalog(conn, "before"), _catalog(conn, "undone")
        record = (
            conn.execute(
                "SELECT version FROM undone.outboxkit_schema_versions WHERE table_name = %s",
                (f"undone.{table}",),
            ).fetchone()
            if kind == "outbox"
            else None
        )
    for part in before:
        ours = [r for r in undone[part] if not str(r[0]).startswith("outboxkit_schema")]
        assert before[part] == ours, f"{part} differ after undoing {kind} version {version}"
    if kind == "outbox":
        assert record == (None if version == 1 else (version - 1,))
