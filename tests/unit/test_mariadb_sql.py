"""MariaDB's named SQL: URLs, identifiers and id lists, without a server."""

from __future__ import annotations

import pytest

from outboxkit.backends.mariadb.sql import Statements, connect_args, is_mysql_url, quote, with_ids
from outboxkit.errors import ConfigurationError


def test_a_mysql_url_becomes_driver_arguments_with_its_password_decoded() -> None:
    args = connect_args("mariadb://app:p%40ss%3Aw@db.internal:3307/shop")
    assert args == {
        "host": "db.internal",
        "port": 3307,
        "user": "app",
        "password": "p@ss:w",
        "database": "shop",
        "charset": "utf8mb4",
    }
    assert connect_args("mysql://app@db/shop")["port"] == 3306


def test_a_url_without_a_database_is_refused_without_quoting_the_password() -> None:
    with pytest.raises(ConfigurationError, match="names no database") as caught:
        connect_args("mysql://app:s3cret@db:3306/")
    assert "s3cret" not in str(caught.value)


def test_only_mysql_and_mariadb_schemes_are_this_backends() -> None:
    assert is_mysql_url("MySQL://db/shop") and is_mysql_url("mariadb://db/shop")
    assert not is_mysql_url("postgresql://db/shop")
    assert not is_mysql_url("host=db dbname=shop")


@pytest.mark.parametrize("name", ["out`box", "a.b.c", "", "x" * 65, "drop table;"])
def test_unusual_table_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="not a plain MariaDB identifier"):
        Statements(name)


def test_names_are_quoted_and_id_lists_expanded() -> None:
    assert quote("shop.outbox") == "`shop`.`outbox`"
    assert with_ids("DELETE FROM t WHERE id {ids}", 3) == "DELETE FROM t WHERE id IN (%s,%s,%s)"
    assert "FOR UPDATE SKIP LOCKED" in Statements().claim_lock
