"""The short autocommit connection the admin commands (status, replay, purge, inbox purge) use."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import errors as pg_errors

#: A DSN, or an open autocommit connection to reuse (the dashboard keeps a few).
Source = str | psycopg.Connection[Any]


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
