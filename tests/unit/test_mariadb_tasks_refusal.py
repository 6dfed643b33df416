"""Which connections task mode refuses as MariaDB/MySQL ones (no server needed: SQLAlchemy
engines and sessions know their dialect before they connect)."""

from __future__ import annotations

import timeit

import pytest
import sqlalchemy
from sqlalchemy.orm import Session

from outboxkit.backends.mariadb.backend import NO_TASKS as MISSING
from outboxkit.errors import ConfigurationError
from outboxkit.tasks.unsupported import refuse_connection, refuse_url


@pytest.mark.parametrize("url", ["mysql://app@db/shop", "MariaDB://app@db/shop"])
def test_a_mysql_or_mariadb_url_is_refused_with_the_one_line(url: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        refuse_url(url)
    assert str(refused.value) == MISSING and "\n" not in MISSING


def test_postgresql_urls_and_connections_pass() -> None:
    refuse_url("postgresql://app@db/shop")
    refuse_url("host=db dbname=shop")
    engine = sqlalchemy.create_engine("postgresql+psycopg://app@127.0.0.1:1/shop")
    refuse_connection(Session(bind=engine))
    refuse_connection(object())  # not a driver's: the adapter lookup refuses it on its own


@pytest.mark.parametrize("url", ["mysql+pymysql://app@127.0.0.1:1/shop", "mariadb+pymysql://a@h/s"])
def test_a_sqlalchemy_session_on_a_mysql_dialect_is_refused(url: str) -> None:
    engine = sqlalchemy.create_engine(url)
    with pytest.raises(ConfigurationError, match="task mode is not available on MariaDB"):
        refuse_connection(Session(bind=engine))
    with pytest.raises(ConfigurationError, match="task mode is not available on MariaDB"):
        refuse_connection(engine)  # an Engine has the dialect too (the adapter refuses it later)


def test_the_check_costs_about_a_microsecond_per_enqueue() -> None:
    class Connection:  # a stand-in type from no database driver (the common psycopg case)
        pass

    conn = Connection()
    seconds = min(timeit.repeat(lambda: refuse_connection(conn), number=10_000, repeat=3))
    assert seconds / 10_000 < 20e-6  # generous: a shared, loaded machine
