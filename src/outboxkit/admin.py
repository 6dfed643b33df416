"""The operator functions of an outbox's database, chosen by its URL: the one backend seam
the CLI (status, failed, replay, discard, purge), the dashboard and the metrics go through.

``admin_for("postgresql://…")`` is PostgreSQL's (outboxkit.backends.postgres.admin and friends);
``admin_for("mysql://…")`` or ``mariadb://`` MariaDB's (outboxkit.backends.mariadb.admin).
Both take the same arguments and return the same shapes (outboxkit.maintenance.report).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from outboxkit.backends.mariadb.sql import is_mysql_url
from outboxkit.maintenance.report import LiveStatus, OutboxStatus


@dataclass(frozen=True, slots=True)
class Admin:
    """One backend's operator functions (each takes a URL or an open connection first)."""

    #: "postgresql" or "mariadb", for messages.
    name: str
    status: Callable[..., OutboxStatus]
    list_failed: Callable[..., list[dict[str, Any]]]
    get_event: Callable[..., dict[str, Any] | None]
    replay: Callable[..., int]
    discard: Callable[..., int]
    purge: Callable[..., int]
    count_purgeable: Callable[..., int]
    live_status: Callable[..., LiveStatus]
    last_event_id: Callable[..., int]
    blocked_keys: Callable[..., list[dict[str, Any]]]
    stray_rows: Callable[..., int]
    purge_inbox: Callable[..., int]
    count_inbox_purgeable: Callable[..., int]
    #: A connection to keep (the dashboard's), whether a kept one still works, and the
    #: errors that mean it died.
    connect: Callable[[str], Any]
    usable: Callable[[Any], bool]
    connection_lost: tuple[type[BaseException], ...]


def admin_for(dsn: str) -> Admin:
    """The operator functions of the database ``dsn`` names (by its scheme).

    Built at each call from the modules' current functions (cheap: the modules are imported
    once), so a test that replaces one of them is heard.
    """
    return _mariadb() if is_mysql_url(dsn) else _postgres()


#: The fields every backend fills from functions of the same name.
_FUNCTIONS = (
    "status",
    "list_failed",
    "get_event",
    "replay",
    "discard",
    "purge",
    "count_purgeable",
    "live_status",
    "last_event_id",
)


def _postgres() -> Admin:
    import psycopg

    from outboxkit.backends.postgres import admin, inbox_sql
    from outboxkit.backends.postgres._connection import connect
    from outboxkit.backends.postgres.ordered_sql import blocked_keys
    from outboxkit.backends.postgres.partitions import stray_rows

    def connect_dashboard(dsn: str) -> Any:
        return connect(dsn, application_name="outboxkit-dashboard")

    def usable(conn: Any) -> bool:
        return not (conn.closed or conn.broken)

    return Admin(
        name="postgresql",
        **{name: getattr(admin, name) for name in _FUNCTIONS},
        blocked_keys=blocked_keys,
        stray_rows=stray_rows,
        purge_inbox=inbox_sql.purge_inbox,
        count_inbox_purgeable=inbox_sql.count_inbox_purgeable,
        connect=connect_dashboard,
        usable=usable,
        connection_lost=(psycopg.OperationalError,),
    )


def _mariadb() -> Admin:
    from outboxkit.backends.mariadb import admin

    others = ("blocked_keys", "stray_rows", "purge_inbox", "count_inbox_purgeable", "connect")
    return Admin(
        name="mariadb",
        **{name: getattr(admin, name) for name in (*_FUNCTIONS, *others, "usable")},
        connection_lost=admin.connection_lost(),
    )
