"""The app's migrations: each applies one version's ``.sql`` file through ``RunSQL``.

The tables are the settings' (``TABLE``, ``INBOX_TABLE``, ``TASKS_TABLE``), read when the
migrations load; ``manage.py sqlmigrate outboxkit 0001`` prints what a migration runs.
"""

from __future__ import annotations

from django.db import migrations

from outboxkit.backends.postgres.migrations import Kind
from outboxkit.backends.postgres.tool_migrations import downgrade_statements, upgrade_statements
from outboxkit.contrib.django import conf


def schema_operations(kind: Kind, version: int) -> list[migrations.RunSQL]:
    """Version ``version`` of ``kind`` (``outbox``, ``inbox`` or ``tasks``) as one ``RunSQL``."""
    c = conf.get()
    table = {"inbox": c.INBOX_TABLE, "tasks": c.TASKS_TABLE}.get(kind, c.TABLE)
    if table is None:  # INBOX_TABLE / TASKS_TABLE = None: no inbox / no task table
        return []
    return [
        migrations.RunSQL(
            sql=list(upgrade_statements(table, kind=kind, version=version)),
            reverse_sql=list(downgrade_statements(table, kind=kind, version=version)),
        )
    ]


def db_table(table: str) -> str:
    """``table`` as Django's ``db_table`` (it quotes the whole name: ``schema"."table``)."""
    schema, _sep, name = table.rpartition(".")
    return f'{schema}"."{name}' if schema else name
