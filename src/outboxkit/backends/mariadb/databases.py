"""Scratch databases on a MariaDB/MySQL server (``outboxkit.testing.create_database``)."""

from __future__ import annotations

import contextlib

from outboxkit.backends.mariadb import sql
from outboxkit.backends.mariadb.migrate import connect
from outboxkit.errors import ConfigurationError

CREATE_DATABASE = "CREATE DATABASE {name}"
DROP_DATABASE = "DROP DATABASE IF EXISTS {name}"
#: Who else is connected to the database (a relay left behind), to be disconnected first:
#: DROP DATABASE would wait for their metadata locks.
SESSIONS_ON = (
    "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = %s AND ID <> CONNECTION_ID()"
)
KILL = "KILL CONNECTION %s"


def create_database(
    admin_dsn: str, name: str, *, template: str | None = None, connect_timeout: int = 10
) -> None:
    """CREATE DATABASE ``name`` (empty: MariaDB/MySQL has no template databases)."""
    if template is not None:
        raise ConfigurationError(
            "create_database(template=...) copies a PostgreSQL template database, which"
            " MariaDB/MySQL has not: create it empty and migrate it (outboxkit migrate --dsn"
            " mysql://…)"
        )
    statement = CREATE_DATABASE.format(name=sql.quote(name))
    conn = connect(admin_dsn, autocommit=True, connect_timeout=connect_timeout)
    try:
        with conn.cursor() as cur:
            cur.execute(statement)
    finally:
        conn.close()


def drop_database(admin_dsn: str, name: str, *, connect_timeout: int = 10) -> None:
    """DROP DATABASE ``name`` if it exists, disconnecting whoever is still connected."""
    statement = DROP_DATABASE.format(name=sql.quote(name))
    conn = connect(admin_dsn, autocommit=True, connect_timeout=connect_timeout)
    try:
        with conn.cursor() as cur:
            cur.execute(SESSIONS_ON, (name,))
            for (session,) in cur.fetchall():
                with contextlib.suppress(Exception):  # it hung up meanwhile
                    cur.execute(KILL, (int(session),))
            cur.execute(statement)
    finally:
        conn.close()
