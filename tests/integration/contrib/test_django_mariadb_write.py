"""The Django app's outbox on a MariaDB default database (Django's own ``mysql`` backend,
mysqlclient), with no MariaDB-only setting: it follows the atomic block's connection.

In a child process: this suite's Django is configured once, on PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pymysql
import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database, driver_module

_CHILD = textwrap.dedent(
    """
    import sys

    import django
    from django.conf import settings

    host, port, user, name = sys.argv[1:5]
    settings.configure(
        DATABASES={"default": {"ENGINE": "django.db.backends.mysql", "HOST": host,
                               "PORT": port, "USER": user, "NAME": name}},
        INSTALLED_APPS=["outboxkit.contrib.django"],
        OUTBOXKIT={"TABLE": "outbox"},  # no storage, no MariaDB-only key
    )
    django.setup()
    from django.db import transaction

    from outboxkit import Event
    from outboxkit.contrib.django import outbox

    with transaction.atomic():
        outbox.put(Event(topic="django.put", event_type="x", payload={}))
        outbox.put_many([Event(topic="django.many", event_type="x", payload={})])
    try:
        with transaction.atomic():
            outbox.put(Event(topic="django.rolled.back", event_type="x", payload={}))
            raise RuntimeError("business failure")
    except RuntimeError:
        pass
    """
)


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    with database(mariadb_server, "dj", migrate) as url:
        yield url


def test_the_django_outbox_writes_a_mariadb_default_database_without_a_setting(
    url: str, tmp_path: Path
) -> None:
    driver_module("django")
    driver_module("MySQLdb")  # Django's mysql backend
    args = connect_args(url)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    done = subprocess.run(
        [sys.executable, str(script), str(args["host"]), str(args["port"]), str(args["user"]),
         str(args["database"])],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    conn = pymysql.connect(**args, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT topic FROM outbox ORDER BY id")
            assert [r[0] for r in cur.fetchall()] == ["django.put", "django.many"]
    finally:
        conn.close()
