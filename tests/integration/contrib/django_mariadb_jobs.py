"""A handler of the app's own task mode (``outboxkit.contrib.django.tasks``) for the MariaDB
project of test_django_mariadb_tasks.py (``manage.py outboxkit_worker --app`` names it)."""

from __future__ import annotations

from typing import Any

from outboxkit.contrib.django import tasks


@tasks.handler("mariadb.note", keep_result=True)
def note(payload: dict[str, Any]) -> str:
    return f"noted {payload['n']}"
