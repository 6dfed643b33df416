"""Scratch databases on a PostgreSQL or MariaDB/MySQL server: one per test, benchmark or demo
run. The server's backend (by the DSN's scheme) runs the statements."""

from __future__ import annotations

import urllib.parse

from outboxkit.backends import backend_for


def dsn_with_dbname(dsn: str, dbname: str) -> str:
    """`dsn` pointing at database `dbname`; URLs stay URLs (asyncpg accepts only those)."""
    if "://" in dsn:  # postgresql://, mysql://, mariadb://
        parts = urllib.parse.urlsplit(dsn)
        return urllib.parse.urlunsplit(parts._replace(path="/" + urllib.parse.quote(dbname)))
    import psycopg  # a libpq conninfo string ("host=… dbname=…"): PostgreSQL's only

    return psycopg.conninfo.make_conninfo(dsn, dbname=dbname)


def create_database(
    admin_dsn: str, name: str, *, template: str | None = None, connect_timeout: int = 10
) -> str:
    """Create database `name` (a copy of `template` if given) and return its DSN.

    `admin_dsn` is any database on the server, for a role allowed to CREATE DATABASE.
    Cloning a migrated template is much faster than migrating every new database; templates
    are PostgreSQL's (on a `mysql://` URL, `template=` is refused: migrate the new one).
    """
    backend_for(admin_dsn).scratch_databases().create_database(
        admin_dsn, name, template=template, connect_timeout=connect_timeout
    )
    return dsn_with_dbname(admin_dsn, name)


def drop_database(admin_dsn: str, name: str, *, connect_timeout: int = 10) -> None:
    """Drop `name` if it exists, disconnecting whoever is still connected (a relay left behind)."""
    backend_for(admin_dsn).scratch_databases().drop_database(
        admin_dsn, name, connect_timeout=connect_timeout
    )
