"""Run by test_django_mariadb_tasks.py in a project on MariaDB (django_mariadb_settings):
``manage.py migrate``, then ``migrate outboxkit zero``, then ``migrate`` again; prints the
outboxkit tables and version records after each, as JSON."""

from __future__ import annotations

import json

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402


def state() -> dict[str, list[str]]:
    with connection.cursor() as cur:
        cur.execute("SHOW TABLES")
        tables = sorted(r[0] for r in cur.fetchall())
        records: list[str] = []
        if "outboxkit_schema_versions" in tables:
            cur.execute(
                "SELECT CONCAT(kind, ':', table_name, ':', version) FROM outboxkit_schema_versions"
            )
            records = sorted(r[0] for r in cur.fetchall())
    return {"tables": [t for t in tables if t != "django_migrations"], "records": records}


seen = []
call_command("migrate", verbosity=0)
seen.append(state())
call_command("migrate", "outboxkit", "zero", verbosity=0)
seen.append(state())
call_command("migrate", verbosity=0)
seen.append(state())
print(json.dumps(seen))
