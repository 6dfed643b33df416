"""The databases outboxkit stores its queues in: one package each (postgres/, mariadb/).

Each package holds its database's SQL, migrations, queue and task stores, admin and
migrator, behind one :class:`~outboxkit.backends.ports.Backend` (its ``backend.py``). The
layers above pick the backend once, here, from a URL (:func:`backend_for`) or from a
connection (:func:`backend_of`), and ask it for a port or whether it can do something;
nothing outside ``backends/`` asks which database it is. A third database is one new
package with its ``Backend`` plus its line here and in the contract suites.
"""

from __future__ import annotations

from typing import Any

from outboxkit.backends.ports import Admin, Backend, Feature

__all__ = ["Admin", "Backend", "Feature", "backend_for", "backend_of"]

#: Modules of the MariaDB/MySQL drivers' connection classes.
_MYSQL_DRIVERS = ("pymysql", "MySQLdb", "aiomysql", "asyncmy", "mariadb")
_MYSQL_DIALECTS = ("mysql", "mariadb")
#: Per connection type: "mysql", "sqlalchemy" (its dialect decides) or "other".
_KINDS: dict[type, str] = {}


def backend_for(dsn: str) -> Backend:
    """The backend of the database ``dsn`` names, by its scheme (``mysql://`` and
    ``mariadb://``: MariaDB/MySQL; anything else: PostgreSQL, whose libpq reads it)."""
    from outboxkit.backends.mariadb.sql import is_mysql_url

    if is_mysql_url(dsn):
        from outboxkit.backends.mariadb.backend import MARIADB

        return MARIADB
    from outboxkit.backends.postgres.backend import POSTGRES

    return POSTGRES


def backend_of(conn: Any) -> Backend:
    """The backend of an open connection: a MariaDB/MySQL driver's connection, or a
    SQLAlchemy connection, engine or session on a MySQL/MariaDB dialect, is MariaDB's;
    any other is PostgreSQL's. Cheap (every ``Outbox.put`` asks it): by type, cached."""
    kind = _KINDS.get(type(conn)) or _kind(type(conn))
    if kind == "sqlalchemy":
        kind = "mysql" if _dialect(conn) in _MYSQL_DIALECTS else "other"
    backend = _BY_KIND.get(kind)
    if backend is None:
        backend = _BY_KIND[kind] = backend_for("mysql://" if kind == "mysql" else "postgresql://")
    return backend


#: The backend of each connection kind, once looked up.
_BY_KIND: dict[str, Backend] = {}


def _kind(conn_type: type) -> str:
    module = conn_type.__module__
    if module.split(".")[0] in _MYSQL_DRIVERS or module.startswith("mysql.connector."):
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
