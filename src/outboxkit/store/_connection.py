"""The one connection factory (connect / aconnect), and the admin commands' short connection."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors

#: A DSN, or an open autocommit connection to reuse (the dashboard keeps a few).
Source = str | psycopg.Connection[Any]

#: Seconds a connection attempt may take, for every connection outboxkit opens.
CONNECT_TIMEOUT = 10


def connect(
    dsn: str,
    *,
    application_name: str,
    autocommit: bool = True,
    connect_timeout: int = CONNECT_TIMEOUT,
) -> psycopg.Connection[Any]:
    """A connection opened the one way: a timeout, and a name ``pg_stat_activity`` shows."""
    return psycopg.connect(
        dsn,
        autocommit=autocommit,
        connect_timeout=connect_timeout,
        application_name=application_name[:63],
    )


async def aconnect(
    dsn: str,
    *,
    application_name: str,
    autocommit: bool = True,
    connect_timeout: int = CONNECT_TIMEOUT,
) -> psycopg.AsyncConnection[Any]:
    """The async :func:`connect`."""
    return await psycopg.AsyncConnection.connect(
        dsn,
        autocommit=autocommit,
        connect_timeout=connect_timeout,
        application_name=application_name[:63],
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
        with psycopg.connect(source, autocommit=True, connect_timeout=10) as conn:
            yield conn
    except pg_errors.UndefinedTable:
        raise table_missing() from None
