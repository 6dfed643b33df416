"""Django's migrations on MariaDB/MySQL: every file ``outboxkit migrate`` applies there is
applied by one of the app's migrations (PostgreSQL's numbering), recorded as migrate records
it, and dropped again by its reverse."""

from __future__ import annotations

from pathlib import Path

import pytest

from outboxkit.backends import backend_for
from outboxkit.backends.mariadb import sql
from outboxkit.backends.mariadb.tool_migrations import PG_VERSION

_DJANGO = Path(__file__).parents[2] / "src/outboxkit/contrib/django/migrations"


@pytest.mark.parametrize("kind", ["outbox", "inbox", "tasks"])
def test_every_mariadb_file_is_applied_by_a_django_migration(kind: sql.Kind) -> None:
    source = "\n".join(p.read_text() for p in _DJANGO.glob("0*.py"))
    for migration in sql.migrations(kind):
        version = PG_VERSION[kind].get(migration.version)
        assert version is not None, f"{migration.name} has no line in PG_VERSION"
        assert f'schema_operations("{kind}", {version})' in source


def test_the_tasks_version_creates_records_and_reverses_its_tables() -> None:
    backend = backend_for("mysql://")
    up, down = backend.tool_migration("tasks", "jobs", 1)
    assert up[0] == sql.CREATE_VERSIONS
    assert up[-1] == (sql.RECORD_VERSION, ("tasks", "jobs", 1))
    created = [s for s in up[1:] if isinstance(s, str) and "CREATE TABLE IF NOT" in s]
    dropped = [s for s in down if isinstance(s, str) and s.startswith("DROP TABLE")]
    assert len(created) == len(dropped) == 6  # the task table and its side tables (as on
    # PostgreSQL, the schedules too)
    assert dropped[-1] == "DROP TABLE IF EXISTS `jobs`"  # the side tables first
    assert down[-1] == (sql.FORGET_VERSIONS, ("tasks", "jobs"))
    # PostgreSQL's later versions are folded into MariaDB's first: nothing to do here
    assert backend.tool_migration("tasks", "jobs", 2) == ([], [])


def test_a_later_tasks_version_creates_its_table_and_forgets_only_its_own_record() -> None:
    up, down = backend_for("mysql://").tool_migration("tasks", "jobs", 9)  # the key buckets
    assert [s for s in up if isinstance(s, str) and "CREATE TABLE IF NOT EXISTS `" in s] == [
        s for s in up if isinstance(s, str) and "jobs_key_rates" in s
    ]
    assert up[-1] == (sql.RECORD_VERSION, ("tasks", "jobs", 2))
    assert down[0] == "DROP TABLE IF EXISTS `jobs_key_rates`"
    assert down[-1] == (sql.FORGET_VERSION, ("tasks", "jobs", 2))  # version 1 stays
