"""Scratch databases on a PostgreSQL server (``outboxkit.testing.create_database``)."""

from __future__ import annotations

from psycopg import sql

from outboxkit.backends.postgres._connection import connect

APPLICATION_NAME = "outboxkit-testing"


def create_database(
    admin_dsn: str, name: str, *, template: str | None = None, connect_timeout: int = 10
) -> None:
    """CREATE DATABASE ``name``, a copy of ``template`` if given."""
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with connect(
        admin_dsn, application_name=APPLICATION_NAME, connect_timeout=connect_timeout
    ) as conn:
        conn.execute(statement)


def drop_database(admin_dsn: str, name: str, *, connect_timeout: int = 10) -> None:
    """DROP DATABASE ``name`` if it exists, disconnecting whoever is still connected."""
    with connect(
        admin_dsn, application_name=APPLICATION_NAME, connect_timeout=connect_timeout
    ) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
