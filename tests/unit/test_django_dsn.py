"""The DSN the Django app makes of a MariaDB/MySQL ``DATABASES`` entry for its commands,
worker and task reads: what ``backends/mariadb`` parses back to the same server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("django")

from outboxkit.backends import backend_for
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.contrib.django.db import _mysql_url, backend_of_django
from outboxkit.errors import ConfigurationError


def _conn(**settings: str) -> SimpleNamespace:
    return SimpleNamespace(alias="default", vendor="mysql", settings_dict=settings)


def test_a_mysql_entry_becomes_a_url_with_its_password_quoted() -> None:
    url = _mysql_url(_conn(NAME="shop", USER="app", PASSWORD="p@ss/word:1", HOST="db",
                           PORT="3307"))  # fmt: skip
    assert connect_args(url) | {"charset": None} == {
        "host": "db", "port": 3307, "user": "app", "database": "shop",
        "password": "p@ss/word:1", "charset": None,
    }  # fmt: skip
    assert backend_for(url).name == "mariadb"
    assert backend_of_django(_conn()).name == "mariadb"


def test_a_socket_only_entry_is_refused_naming_host_and_port() -> None:
    with pytest.raises(ConfigurationError, match="set HOST and PORT"):
        _mysql_url(_conn(NAME="shop", HOST="/run/mysqld/mysqld.sock"))


def test_another_vendor_is_refused_naming_the_two_backends() -> None:
    sqlite = SimpleNamespace(alias="default", vendor="sqlite", settings_dict={})
    with pytest.raises(ConfigurationError, match=r"django.db.backends.mysql"):
        backend_of_django(sqlite)
