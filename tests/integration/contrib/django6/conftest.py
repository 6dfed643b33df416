"""One migrated database for the Django 6 tests; Django configured from settings.py.

Loaded alone in build/django6-venv (``--confcutdir`` here): the suite's conftests need the
dev extra, which that venv has not. Under the suite's own run the tests skip at import.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo


@pytest.fixture(scope="session")
def django6_dsn() -> Iterator[str]:
    server = os.environ["OUTBOXKIT_TEST_DSN"]
    name = f"django6_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = make_conninfo(server, dbname=name)
    os.environ["OUTBOXKIT_TEST_DJANGO_DSN"] = dsn
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.integration.contrib.django6.settings"
    import django
    from django.core.management import call_command
    from django.db import connections

    django.setup()
    call_command("migrate", verbosity=0)
    try:
        yield dsn
    finally:
        connections.close_all()
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture
def django6(django6_dsn: str) -> str:
    """The database, its task table emptied for this test."""
    assert conninfo_to_dict(django6_dsn)["dbname"]
    with psycopg.connect(django6_dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outboxkit_tasks")
    return django6_dsn
