"""Scratch databases on a PostgreSQL server: one per test, benchmark or demo run."""

from __future__ import annotations

import urllib.parse

import psycopg
from psycopg import sql

from outboxkit.backends.postgres._connection import connect

APPLICATION_NAME = "outboxkit-testing"


def dsn_with_dbname(dsn: str, dbname: str) -> str:
    """`dsn` pointing at database `dbname`; URLs stay URLs (asyncpg accepts only those)."""
    if dsn.startswith(("postgresql://", "postgres://")):
        parts = urllib.parse.urlsplit(dsn)
        return urllib.parse.urlunsplit(parts._replace(path="/" + urllib.parse.quote(dbname)))
    return psycopg.conninfo.make_conninfo(dsn, dbname=dbname)


def create_database(
    admin_dsn: str, name: str, *, template: str | None = None, connect_timeout: int = 10
) -> str:
    """Create database `name` (a copy of `template` if given) and return its DSN.

    `admin_dsn` is any database on the server, for a role allowed to CREATE DATABASE.
    Cloning a migrated template is much faster than migrating every new database.
    """
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with connect(
        admin_dsn, application_name=APPLICATION_NAME, connect_timeout=connect_timeout
    ) as conn:
        conn.execute(statement)
    return dsn_with_dbname(admin_dsn, name)


def drop_database(admin_dsn: str, name: str, *, connect_timeout: int = 10) -> None:
    """Drop `name` if it exists, disconnecting whoever is still connected (a relay left behind)."""
    with connect(
        admin_dsn, application_name=APPLICATION_NAME, connect_timeout=connect_timeout
    ) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
