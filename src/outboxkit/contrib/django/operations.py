"""The app's migrations: each applies one schema version through a ``RunSQL`` whose
statements are the migrating database's (``outboxkit migrate``'s files, recorded alike).

The versions are PostgreSQL's; on MariaDB/MySQL its backend says what each one brings there
(backends/mariadb/tool_migrations.py). The tables are the settings' (``TABLE``,
``INBOX_TABLE``, ``TASKS_TABLE``), read when the migrations load; ``manage.py sqlmigrate
outboxkit 0001`` prints what a migration runs on the database it names.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, router

from outboxkit.backends.ports import MigrationKind
from outboxkit.contrib.django import conf
from outboxkit.contrib.django.db import backend_of_django


class SchemaVersion(migrations.RunSQL):
    """``RunSQL`` of version ``version`` of ``kind`` on ``table``, its statements asked of
    the backend of the database being migrated."""

    def __init__(self, kind: MigrationKind, version: int, table: str) -> None:
        self.kind, self.version, self.table = kind, version, table
        super().__init__(sql=[], reverse_sql=[])  # chosen by the database, when it runs

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (type(self).__name__, [self.kind, self.version, self.table], {})

    def database_forwards(self, app_label: str, schema_editor: Any, *_state: Any) -> None:
        self._run(app_label, schema_editor, forwards=True)

    def database_backwards(self, app_label: str, schema_editor: Any, *_state: Any) -> None:
        self._run(app_label, schema_editor, forwards=False)

    def _run(self, app_label: str, schema_editor: Any, *, forwards: bool) -> None:
        conn = schema_editor.connection
        if router.allow_migrate(conn.alias, app_label, **self.hints):
            backend = backend_of_django(conn)
            up, down = backend.tool_migration(self.kind, self.table, self.version)
            self._run_sql(schema_editor, up if forwards else down)

    def describe(self) -> str:
        return f"outboxkit's {self.kind} table {self.table!r}, schema version {self.version}"


def schema_operations(kind: MigrationKind, version: int) -> list[migrations.RunSQL]:
    """Version ``version`` of ``kind`` (``outbox``, ``inbox`` or ``tasks``) as one ``RunSQL``."""
    c = conf.get()
    table = {"inbox": c.INBOX_TABLE, "tasks": c.TASKS_TABLE}.get(kind, c.TABLE)
    if table is None:  # INBOX_TABLE / TASKS_TABLE = None: no inbox / no task table
        return []
    return [SchemaVersion(kind, version, table)]


def db_table(table: str) -> str:
    """``table`` as Django's ``db_table`` (it quotes the whole name: ``schema"."table``)."""
    schema, _sep, name = table.rpartition(".")
    return f'{schema}"."{name}' if schema else name
