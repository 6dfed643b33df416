"""The operator functions of an outbox's database, chosen by its URL: what the CLI (status,
failed, replay, discard, purge), the dashboard and the metrics go through.

``admin_for("postgresql://…")`` is PostgreSQL's, ``admin_for("mysql://…")`` or
``mariadb://`` MariaDB's: each backend's :class:`~outboxkit.backends.ports.Admin`
(backends/*/backend.py), with the same arguments and result shapes
(outboxkit.maintenance.report).
"""

from __future__ import annotations

from outboxkit.backends import Admin, backend_for

__all__ = ["Admin", "admin_for"]


def admin_for(dsn: str) -> Admin:
    """The operator functions of the database ``dsn`` names (by its scheme).

    Built at each call from the modules' current functions (cheap: the modules are imported
    once), so a test that replaces one of them is heard.
    """
    return backend_for(dsn).admin()
