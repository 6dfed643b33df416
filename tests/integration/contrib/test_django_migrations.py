"""The app's migrations apply the versioned SQL files: ``manage.py migrate`` and ``outboxkit
migrate`` make the same schema and keep the same version record, in either order."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit.backends.postgres.migrate import (
    MigrationAction,
    migrate,
    migrate_inbox,
    migrate_tasks,
)
from outboxkit.backends.postgres.migrations import migration_files
from outboxkit.backends.postgres.postgres import SCHEMA_VERSION
from outboxkit.testing import create_database, drop_database
from tests.integration.contrib.conftest import django_migrate, point_django_at
from tests.integration.test_migration_files import _apply, _catalog, _record
from tests.support.servers import unique_name

_OURS = ("outbox", "processed_events")  # outbox, its indexes and sequence, the records
_TASKS = ("outboxkit_tasks", "outboxkit_schedules")  # task mode's tables, indexes, sequence


def _schema(dsn: str, ours: tuple[str, ...] = _OURS) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        whole = _catalog(conn, "public")
    found = {part: [r for r in rows if str(r[0]).startswith(ours)] for part, rows in whole.items()}
    if ours is _OURS:  # outbox* matches outboxkit_tasks too
        found = {
            p: [r for r in rows if not str(r[0]).startswith(_TASKS)] for p, rows in found.items()
        }
    return found


def _record_of(dsn: str, table_name: str = "outbox") -> tuple[int, Any] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT version, applied_at FROM outboxkit_schema_versions WHERE table_name = %s",
            (table_name,),
        ).fetchone()
    return None if row is None else (row[0], row[1])


@pytest.fixture
def second_db(pg_server: Any) -> Iterator[str]:
    name = unique_name("test")
    create_database(pg_server.dsn, name)
    yield pg_server.dsn_for(name)
    drop_database(pg_server.dsn, name)


def _outboxkit_migrate(dsn: str) -> None:
    assert migrate(dsn).action is MigrationAction.CREATED
    assert migrate_inbox(dsn).action is MigrationAction.CREATED
    assert migrate_tasks(dsn).action is MigrationAction.CREATED


def test_manage_py_migrate_makes_the_schema_outboxkit_migrate_makes(
    django_configured: None, empty_db_dsn: str, second_db: str
) -> None:
    django_migrate(empty_db_dsn)
    _outboxkit_migrate(second_db)
    by_django, by_outboxkit = _schema(empty_db_dsn), _schema(second_db)
    assert by_django["columns"], "manage.py migrate made no outbox table"
    for part in by_django:
        assert by_django[part] == by_outboxkit[part], f"{part} differ"
    assert _record_of(empty_db_dsn) is not None
    assert _record_of(empty_db_dsn)[0] == _record_of(second_db)[0] == SCHEMA_VERSION  # type: ignore[index]


def test_manage_py_migrate_makes_the_task_table_outboxkit_migrate_tasks_makes(
    django_configured: None, empty_db_dsn: str, second_db: str
) -> None:
    django_migrate(empty_db_dsn)
    assert migrate_tasks(second_db).action is MigrationAction.CREATED
    by_django, by_outboxkit = _schema(empty_db_dsn, _TASKS), _schema(second_db, _TASKS)
    assert {r[0] for r in by_django["columns"]} >= set(_TASKS), "no task tables made"
    for part in by_django:
        assert by_django[part] == by_outboxkit[part], f"{part} differ"
    django_record = _record_of(empty_db_dsn, "tasks:outboxkit_tasks")
    assert django_record is not None, "manage.py migrate kept no version record of the tasks"
    assert django_record[0] == _record_of(second_db, "tasks:outboxkit_tasks")[0]  # type: ignore[index]
    assert migrate_tasks(empty_db_dsn).action is MigrationAction.UNCHANGED
    assert _record_of(empty_db_dsn, "tasks:outboxkit_tasks") == django_record


def test_outboxkit_migrate_after_manage_py_migrate_has_nothing_to_do(
    django_configured: None, empty_db_dsn: str
) -> None:
    django_migrate(empty_db_dsn)
    assert migrate(empty_db_dsn).action is MigrationAction.UNCHANGED
    assert migrate_inbox(empty_db_dsn).action is MigrationAction.UNCHANGED
    assert migrate_tasks(empty_db_dsn).action is MigrationAction.UNCHANGED


def test_manage_py_migrate_after_outboxkit_migrate_changes_nothing(
    django_configured: None, empty_db_dsn: str
) -> None:
    _outboxkit_migrate(empty_db_dsn)
    before, record = _schema(empty_db_dsn), _record_of(empty_db_dsn)
    django_migrate(empty_db_dsn)
    assert _schema(empty_db_dsn) == before
    assert _record_of(empty_db_dsn) == record  # not even applied_at was rewritten


@pytest.mark.parametrize("start", range(1, SCHEMA_VERSION))
def test_manage_py_migrate_upgrades_an_older_outbox_like_outboxkit_migrate(
    django_configured: None, empty_db_dsn: str, second_db: str, start: int
) -> None:
    _apply(empty_db_dsn, "outbox", "outbox", through=start)
    _record(empty_db_dsn, "outbox", start)
    django_migrate(empty_db_dsn)
    _outboxkit_migrate(second_db)
    assert _schema(empty_db_dsn) == _schema(second_db)
    assert _record_of(empty_db_dsn)[0] == SCHEMA_VERSION  # type: ignore[index]


def test_migrating_the_app_to_zero_drops_its_tables_and_forward_again_rebuilds_them(
    django_configured: None, empty_db_dsn: str
) -> None:
    from django.core.management import call_command
    from django.db import connections

    django_migrate(empty_db_dsn)
    made, made_tasks = _schema(empty_db_dsn), _schema(empty_db_dsn, _TASKS)
    point_django_at(empty_db_dsn)
    call_command("migrate", "outboxkit", "0001", verbosity=0)
    assert _record_of(empty_db_dsn)[0] == 1  # type: ignore[index]
    call_command("migrate", "outboxkit", "zero", verbosity=0)
    connections.close_all()
    # Nothing of the app's is left; the version records (shared by every outbox of the
    # schema, left out of the catalog) stay, without the outbox's.
    assert {r[0] for r in _schema(empty_db_dsn)["columns"]} == set()
    assert _schema(empty_db_dsn, _TASKS)["columns"] == []
    assert _record_of(empty_db_dsn, "tasks:outboxkit_tasks") is None
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('outboxkit_schema_versions')").fetchone() != (None,)
    assert _record_of(empty_db_dsn) is None
    django_migrate(empty_db_dsn)
    assert _schema(empty_db_dsn) == made
    assert _schema(empty_db_dsn, _TASKS) == made_tasks


def test_every_schema_version_has_its_django_migration() -> None:
    import outboxkit.contrib.django.migrations as package

    names = sorted(p.stem for p in Path(package.__path__[0]).glob("[0-9]*.py"))
    stems = [re.sub(r"^\d+_", "", n) for n in names]
    expected = [f.name.removesuffix(".sql")[5:] for f in migration_files("outbox")]
    expected += [f.name.removesuffix(".sql")[5:] for f in migration_files("inbox")]
    expected += [f.name.removesuffix(".sql")[5:] for f in migration_files("tasks")]
    assert stems == expected, "add a Django migration for each new .sql file, in order"


def test_the_models_need_no_new_migration(django_dsn: str) -> None:
    from django.core.management import call_command

    call_command("makemigrations", "outboxkit", "--check", "--dry-run", verbosity=0)
