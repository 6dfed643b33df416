"""MariaDB/MySQL's statements on the fleet's lease table (run by fleet_leases.py).

PostgreSQL's table and checks (backends/postgres/fleet_sql.py) in MariaDB's SQL: the table is
migrations/fleet/0001_fleet.sql (``outboxkit migrate --fleet``, or a lease check's first use);
times are the database's clock (``UTC_TIMESTAMP(6)``), so the processes' clocks never decide
a lease. A check is serialized per database and service by a named lock instead of
PostgreSQL's transaction advisory lock: ``GET_LOCK`` names are server-wide, so the name holds
the database's (hashed, to fit MariaDB's 64 characters).
"""

from __future__ import annotations

from outboxkit.backends.mariadb.sql import NOW

TABLE = "outboxkit_fleet"

#: ``%s``: the service, then the seconds to wait for a check under way elsewhere.
LOCK = "SELECT GET_LOCK(CONCAT('outboxkit_fleet:', SHA1(CONCAT(DATABASE(), '/', %s))), %s)"
#: A process not seen for a lease is gone: its heartbeat and its ownership go with it.
EXPIRE = f"DELETE FROM {TABLE} WHERE service = %s AND expires_at < {NOW}"
#: ``%s``: service, member, the lease in microseconds (twice).
HEARTBEAT = (
    f"INSERT INTO {TABLE} (service, member, expires_at)"
    f" VALUES (%s, %s, {NOW} + INTERVAL %s MICROSECOND)"
    f" ON DUPLICATE KEY UPDATE expires_at = {NOW} + INTERVAL %s MICROSECOND"
)
#: Take (or keep) the service unless another live process owns it (a self-join: MySQL
#: refuses a subquery on the table an UPDATE changes). ``%s``: service, member.
TAKE = (
    f"UPDATE {TABLE} AS me LEFT JOIN {TABLE} AS other"
    " ON other.service = me.service AND other.owner AND other.member <> me.member"
    " SET me.owner = TRUE WHERE me.service = %s AND me.member = %s AND other.member IS NULL"
)
GIVE_UP = f"UPDATE {TABLE} SET owner = FALSE WHERE service = %s AND member = %s AND owner"
SEEN = f"SELECT member, owner FROM {TABLE} WHERE service = %s"
LEAVE = f"DELETE FROM {TABLE} WHERE service = %s AND member = %s"
#: ``status``: the owner of a service and the microseconds left of its lease.
OWNER = (
    f"SELECT member, TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at) FROM {TABLE}"
    " WHERE service = %s AND owner"
)
EXISTS = (
    "SELECT COUNT(*) FROM information_schema.TABLES"
    f" WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = '{TABLE}'"
)
