"""Task mode on MariaDB/MySQL: refused where it starts, in one line naming what is missing.

Issue 23 asks for task mode there "through the same backend interface, or refused with a
clear message naming what is missing". The backend interface exists (the queue core's
QueueStore, which MariaDB's outbox store implements); a MariaDB *task* store does not yet,
so every entry point (enqueue, the Worker, `outboxkit worker`, `outboxkit tasks …`,
`outboxkit migrate --tasks`) refuses a MariaDB URL or connection before doing anything.
"""

from __future__ import annotations

from typing import Any

from outboxkit.backends.mariadb.sql import is_mysql_url
from outboxkit.errors import ConfigurationError

#: What task mode on MariaDB/MySQL lacks, said once for every entry point.
MISSING = (
    "task mode is not available on MariaDB/MySQL yet: it needs a MariaDB task store"
    " (the tasks table and its migration, the claim with per-key heads and unique_key,"
    " settles and ctx.transaction() fenced by the claim token), which outboxkit does not"
    " have; run task mode on PostgreSQL (the outbox, the inbox and the relay do work on"
    " MariaDB/MySQL)"
)
#: Modules of the MariaDB/MySQL drivers' connection classes.
_DRIVERS = ("pymysql", "MySQLdb", "aiomysql", "asyncmy", "mariadb")
_MYSQL_DIALECTS = ("mysql", "mariadb")
#: Per connection type: "mysql" (refused), "sqlalchemy" (its dialect decides) or "other".
_KINDS: dict[type, str] = {}


def refuse_url(dsn: str) -> None:
    """Raise ConfigurationError (``MISSING``) if ``dsn`` names a MariaDB/MySQL server."""
    if is_mysql_url(dsn):
        raise ConfigurationError(MISSING)


def refuse_connection(conn: Any) -> None:
    """Raise ConfigurationError (``MISSING``) for a MariaDB/MySQL driver's connection, or a
    SQLAlchemy connection or session on a MySQL/MariaDB dialect. Cheap: by type, cached."""
    kind = _KINDS.get(type(conn)) or _kind(type(conn))
    if kind == "other":
        return
    if kind == "mysql" or _dialect(conn) in _MYSQL_DIALECTS:
        raise ConfigurationError(MISSING)


def _kind(conn_type: type) -> str:
    module = conn_type.__module__
    if module.split(".")[0] in _DRIVERS or module.startswith("mysql.connector."):
        kind = "mysql"
    elif module.startswith("sqlalchemy."):
        kind = "sqlalchemy"
    else:
        kind = "other"
    _KINDS[conn_type] = kind
    return kind


def _dialect(conn: Any) -> str | None:
    """A SQLAlchemy Connection's, Engine's or Session's dialect name, or None."""
    dialect = getattr(conn, "dialect", None)
    if dialect is None and hasattr(conn, "get_bind"):
        try:
            dialect = conn.get_bind().dialect
        except Exception:  # an unbound session: the adapter refuses it on its own
            return None
    return getattr(dialect, "name", None)
