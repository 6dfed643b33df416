"""Django for the contrib tests, configured here and only when one of them runs.

The rest of the suite never sees DJANGO_SETTINGS_MODULE: Django is configured in-process
(``settings.configure``) by the first fixture that needs it. Each test gets a database of
its own, cloned from one that ``manage.py migrate`` made once per session.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict

from outboxkit.testing import create_database, drop_database
from tests.support.servers import unique_name


def point_django_at(dsn: str) -> None:
    """Every alias of DATABASES to the database of ``dsn`` (connections closed first)."""
    from django.db import connections

    connections.close_all()
    params = conninfo_to_dict(dsn)
    for alias in connections:
        connections[alias].settings_dict.update(
            NAME=params.get("dbname", ""),
            USER=params.get("user", ""),
            PASSWORD=params.get("password", ""),
            HOST=params.get("host", ""),
            PORT=params.get("port", ""),
        )


@pytest.fixture(scope="session")
def django_configured(request: pytest.FixtureRequest) -> Iterator[None]:
    import django
    from django.conf import settings

    from tests.integration.contrib import django_settings

    if not settings.configured:
        settings.configure(
            **{k: getattr(django_settings, k) for k in dir(django_settings) if k.isupper()}
        )
        django.setup()
    try:
        blocker = request.getfixturevalue("django_db_blocker")
    except pytest.FixtureLookupError:  # pytest-django not installed: nothing blocks
        blocker = None
    if blocker is None:  # or pytest-django saw no settings at start: it blocks nothing
        yield
        return
    with blocker.unblock():
        yield


def django_migrate(dsn: str) -> None:
    """``manage.py migrate`` on the database of ``dsn``."""
    from django.core.management import call_command
    from django.db import connections

    point_django_at(dsn)
    call_command("migrate", verbosity=0)
    connections.close_all()


@pytest.fixture(scope="session")
def django_template(django_configured: None, pg_server: Any) -> Iterator[str]:
    """A database ``manage.py migrate`` made (auth, admin, outboxkit), cloned per test."""
    name = unique_name("django_template")
    create_database(pg_server.dsn, name)
    try:
        django_migrate(pg_server.dsn_for(name))
        yield name
    finally:
        from django.db import connections

        connections.close_all()
        drop_database(pg_server.dsn, name)


@pytest.fixture
def django_dsn(django_template: str, pg_server: Any) -> Iterator[str]:
    """DSN of this test's own migrated database; Django's aliases point at it."""
    from django.db import connections

    name = unique_name("django")
    create_database(pg_server.dsn, name, template=django_template)
    dsn = pg_server.dsn_for(name)
    point_django_at(dsn)
    try:
        yield dsn
    finally:
        connections.close_all()
        drop_database(pg_server.dsn, name)
