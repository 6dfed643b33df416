"""Every connection the library opens: one factory (sync and async), and the admin commands' one.

One place for the connect timeout and the ``application_name`` each part of outboxkit shows
in ``pg_stat_activity`` (``outboxkit-relay:claim``, ``outboxkit-admin``, ...), so an
operator can tell them apart and a dead server is noticed after the same time everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors

#: A DSN, or an open autocommit connection to reuse (the dashboard keeps a few).
Source = str | psycopg.Connection[Any]

#: Seconds a connection attempt may take before it fails (libpq's ``connect_timeout``).
CONNECT_TIMEOUT = 10
#: The admin commands' connections (status, replay, purge, migrate, partitions, inbox purge).
ADMIN_APPLICATION_NAME = "outboxkit-admin"


def _options(application_name: str, autocommit: bool, connect_timeout: int) -> dict[str, Any]:
    return {
        "autocommit": autocommit,
        "connect_timeout": connect_timeout,
        "application_name": application_name[:63],  # what PostgreSQL keeps of a name
    }


def connect(
    dsn: str,
    *,
    application_name: str,
    autocommit: bool = True,
    connect_timeout: int = CONNECT_TIMEOUT,
) -> psycopg.Connection[Any]:
    """A psycopg connection named ``application_name`` (it overrides one in the DSN)."""
    return psycopg.connect(dsn, **_options(application_name, autocommit, connect_timeout))


async def aconnect(
    dsn: str,
    *,
    application_name: str,
    autocommit: bool = True,
    connect_timeout: int = CONNECT_TIMEOUT,
) -> psycopg.AsyncConnection[Any]:
    """The async twin of :func:`connect`."""
    return await psycopg.AsyncConnection.connect(
        dsn, **_options(application_name, autocommit, connect_timeout)
    )


@contextmanager
def admin_connection(
    source: Source, table_missing: Callable[[], Exception]
) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection (``source`` itself if it is one, left open).

    A statement that finds no table raises ``table_missing()``, the error that says which
    migration creates it, instead of psycopg's "relation does not exist".
    """
    try:
        if isinstance(source, psycopg.Connection):
            yield source
            return
        with connect(source, application_name=ADMIN_APPLICATION_NAME) as conn:
            yield conn
    except pg_errors.UndefinedTable:
        raise table_missing() from None
