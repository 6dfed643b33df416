"""Django's database connections as outboxkit needs them: the open transaction, or a DSN."""

from __future__ import annotations

from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from psycopg.conninfo import make_conninfo

from outboxkit.errors import ConfigurationError, NotInTransactionError

#: Django's database vendors outboxkit writes through: the outbox follows the connection.
_VENDORS = ("postgresql", "mysql")


def atomic_connection(using: str | None, action: str) -> Any:
    """Django's connection ``using`` (default: ``default``), inside ``transaction.atomic()``.

    Refused outside an atomic block: Django runs in autocommit there, so the event would
    commit on its own, without the change it describes. ``ATOMIC_REQUESTS`` is an atomic
    block around the view.
    """
    alias = using or DEFAULT_DB_ALIAS
    conn = connections[alias]
    if conn.vendor not in _VENDORS:
        raise ConfigurationError(
            f"database {alias!r} uses the {conn.vendor} backend; outboxkit needs PostgreSQL"
            " (django.db.backends.postgresql) or MariaDB/MySQL (django.db.backends.mysql)"
        )
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


def dsn_for(using: str | None = None) -> str:
    """A libpq connection string for Django's database ``using``, from DATABASES.

    For the relay and the admin functions, which open connections of their own. It holds
    the password: pass it on, never print it.
    """
    alias = using or DEFAULT_DB_ALIAS
    conn = connections[alias]
    if conn.vendor != "postgresql":
        raise ConfigurationError(
            f"database {alias!r} uses the {conn.vendor} backend; outboxkit needs PostgreSQL"
        )
    params = dict(conn.get_connection_params())
    if "database" in params:  # Django < 4.2 (psycopg2) names it so
        params["dbname"] = params.pop("database")
    kept = {
        k: v
        for k, v in params.items()
        if k not in _NOT_LIBPQ and isinstance(v, str | int) and not isinstance(v, bool)
    }
    return make_conninfo("", **kept)
