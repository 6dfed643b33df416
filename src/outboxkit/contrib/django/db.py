"""Django's database connections as outboxkit needs them: the open transaction, or a DSN."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from psycopg.conninfo import make_conninfo

from outboxkit.backends import Backend, backend_for
from outboxkit.errors import ConfigurationError, NotInTransactionError


def atomic_connection(using: str | None, action: str) -> Any:
    """Django's connection ``using`` (default: ``default``), inside ``transaction.atomic()``.

    Refused outside an atomic block: Django runs in autocommit there, so the event would
    commit on its own, without the change it describes. ``ATOMIC_REQUESTS`` is an atomic
    block around the view.
    """
    alias = using or DEFAULT_DB_ALIAS
    conn = connections[alias]
    _vendor(conn)  # another vendor: refused before anything is written
    if not conn.in_atomic_block:
        where = "" if alias == DEFAULT_DB_ALIAS else f"using={alias!r}"
        raise NotInTransactionError(
            f"cannot {action} outside a transaction on database {alias!r}: Django is in"
            f" autocommit there, so it would commit without your change; call it inside"
            f" `with transaction.atomic({where}):` (or a view under ATOMIC_REQUESTS)"
        )
    if conn.needs_rollback:
        raise NotInTransactionError(
            f"the transaction.atomic() block on database {alias!r} is marked for rollback"
            " (a query in it failed); leave the block and retry the whole unit of work"
        )
    conn.validate_thread_sharing()
    conn.ensure_connection()
    return conn


# Connection parameters Django hands the driver that libpq does not know.
_NOT_LIBPQ = frozenset(
    {"cursor_factory", "context", "prepare_threshold", "connection_factory", "pool"}
)


def _libpq_dsn(conn: Any) -> str:
    params = dict(conn.get_connection_params())
    if "database" in params:  # Django < 4.2 (psycopg2) names it so
        params["dbname"] = params.pop("database")
    kept = {
        k: v
        for k, v in params.items()
        if k not in _NOT_LIBPQ and isinstance(v, str | int) and not isinstance(v, bool)
    }
    return make_conninfo("", **kept)


def _mysql_url(conn: Any) -> str:
    """``mysql://`` from the entry's HOST, PORT, USER, PASSWORD and NAME (the test run's
    database once Django created it): what ``backends/mariadb`` parses."""
    s = conn.settings_dict
    quote = urllib.parse.quote
    user = quote(str(s.get("USER") or "root"), safe="")
    password = s.get("PASSWORD")
    login = f"{user}:{quote(str(password), safe='')}" if password else user
    host = s.get("HOST") or "127.0.0.1"
    if str(host).startswith("/"):
        raise ConfigurationError(
            f"database {conn.alias!r} reaches MariaDB/MySQL through the socket {host}:"
            " outboxkit's own connections (the worker, the relay, the task reads) need TCP:"
            " set HOST and PORT"
        )
    port = f":{s['PORT']}" if s.get("PORT") else ""
    return f"mysql://{login}@{host}{port}/{quote(str(s['NAME']), safe='')}"


#: Django's database vendors outboxkit works through: the URL scheme that picks the backend
#: (``backends.backend_for``), and the DSN of an entry of DATABASES. The writes follow the
#: connection; the commands, the worker and the migrations ask the backend.
_VENDORS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "postgresql": ("postgresql://", _libpq_dsn),
    "mysql": ("mysql://", _mysql_url),
}


def _vendor(conn: Any) -> tuple[str, Callable[[Any], str]]:
    """``_VENDORS``' entry of Django connection ``conn``; ConfigurationError for another."""
    found = _VENDORS.get(conn.vendor)
    if found is None:
        raise ConfigurationError(
            f"database {conn.alias!r} uses the {conn.vendor} backend; outboxkit needs PostgreSQL"
            " (django.db.backends.postgresql) or MariaDB/MySQL (django.db.backends.mysql)"
        )
    return found


def dsn_for(using: str | None = None) -> str:
    """A DSN for Django's database ``using``, from DATABASES: libpq's connection string on
    PostgreSQL, ``mysql://`` on MariaDB/MySQL.

    For the relay, the worker and the admin functions, which open connections of their own.
    It holds the password: pass it on, never print it.
    """
    conn = connections[using or DEFAULT_DB_ALIAS]
    return _vendor(conn)[1](conn)


def backend_of_django(conn: Any) -> Backend:
    """outboxkit's backend of the database behind Django connection ``conn`` (the
    migrations ask it for their statements, without connecting)."""
    return backend_for(_vendor(conn)[0])
