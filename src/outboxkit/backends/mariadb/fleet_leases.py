"""MariaDB/MySQL's lease of a fleet process on one database (the port of
queue/fleet_leases.py; fleet/leases.py divides the databases; the SQL is fleet_sql.py).

A check is PostgreSQL's: one short transaction on a connection of its own, closed after (a
database this process does not serve holds none of its connections), under a named lock per
database and service, so two processes never both take a free database; a process not seen
for a lease, by the database's clock, is gone and its ownership with it, so a process whose
check came late finds the database owned by another and stops serving it. A database without
the table gets it at its first check, by the migration ``outboxkit migrate --fleet`` runs (a
role that may not create it fails there, and that database is not served).
"""

from __future__ import annotations

import asyncio
from typing import Any

from outboxkit.backends.mariadb import fleet_sql
from outboxkit.backends.mariadb.session import NO_TABLE, micros, quiet_cursor
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.queue.fleet_leases import Sighting


class MariaDBFleetLease:
    """One fleet process's lease checks on one MariaDB/MySQL database."""

    def __init__(self, dsn: str, service: str, member: str, ttl: float) -> None:
        self.dsn = dsn
        self.service = service
        self.member = member
        self.ttl = ttl

    async def _connect(self) -> Any:
        import aiomysql

        args = connect_args(self.dsn)
        args["db"] = args.pop("database")
        return await aiomysql.connect(
            **args, autocommit=True, connect_timeout=10, cursorclass=quiet_cursor()
        )

    async def check(self, want: bool) -> Sighting:
        import pymysql

        try:
            return await self._check(want)
        except pymysql.err.ProgrammingError as exc:
            if not exc.args or exc.args[0] != NO_TABLE:
                raise
        await asyncio.to_thread(create_table, self.dsn)
        return await self._check(want)

    async def _check(self, want: bool) -> Sighting:
        service, member, lease = self.service, self.member, micros(self.ttl)
        conn = await self._connect()
        try:  # (closing the connection rolls back and releases the lock, whatever failed)
            async with conn.cursor() as cur:
                await cur.execute(fleet_sql.LOCK, (service, max(1, round(self.ttl / 3))))
                (got,) = await cur.fetchone()
                if got != 1:
                    raise TimeoutError("another process's lease check held this database")
                await conn.begin()
                await cur.execute(fleet_sql.EXPIRE, (service,))
                await cur.execute(fleet_sql.HEARTBEAT, (service, member, lease, lease))
                await cur.execute(fleet_sql.TAKE if want else fleet_sql.GIVE_UP, (service, member))
                await cur.execute(fleet_sql.SEEN, (service,))
                rows = await cur.fetchall()
                await conn.commit()
        finally:
            conn.close()
        owner = next((str(who) for who, owns in rows if owns), None)
        return Sighting(owner=owner, members=frozenset(str(who) for who, _ in rows))

    async def leave(self) -> None:
        import pymysql

        conn = await self._connect()
        try:
            async with conn.cursor() as cur:
                await cur.execute(fleet_sql.LEAVE, (self.service, self.member))
        except pymysql.err.ProgrammingError as exc:
            if not exc.args or exc.args[0] != NO_TABLE:
                raise
        finally:
            conn.close()


def create_table(dsn: str) -> bool:
    """Create the lease table if missing (``migrate --fleet``, or a check's first use), as a
    versioned migration; True if it was missing."""
    from outboxkit.backends.mariadb.migrate import connect, migrate

    conn = connect(dsn, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(fleet_sql.EXISTS)
            existed = bool(cur.fetchone()[0])
    finally:
        conn.close()
    migrate(dsn, table=fleet_sql.TABLE, kind="fleet")
    return not existed


def lease_owner(dsn: str, service: str) -> tuple[str, float] | None:
    """The member serving ``service`` and the seconds left of its lease (``status``)."""
    import pymysql

    from outboxkit.backends.mariadb.migrate import connect

    conn = connect(dsn, autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(fleet_sql.OWNER, (service,))
            row = cur.fetchone()
    except pymysql.err.ProgrammingError as exc:
        if exc.args and exc.args[0] == NO_TABLE:
            return None
        raise
    finally:
        conn.close()
    return (str(row[0]), int(row[1]) / 1e6) if row else None
