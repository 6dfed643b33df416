"""PostgreSQL's statements on the fleet's lease table (the port of fleet/leases.py).

One small table per database, ``outboxkit_fleet``: ``outboxkit migrate --fleet`` creates it
(so the relay's role needs no CREATE privilege), and a lease check creates it on first use
when it is missing (``CREATE TABLE IF NOT EXISTS``: a database joins a fleet unmigrated).
A row per fleet process that saw the database within a lease (its heartbeat), and at most
one of them marked ``owner`` per service (a relay of one outbox table, a worker of one task
table): the process that serves it. Each check is one short transaction on a connection of its own,
serialized per service by a transaction advisory lock (so two processes never both take a
free database), fine through a transaction pooler.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import errors as pg_errors

from outboxkit.backends.postgres._connection import aconnect
from outboxkit.queue.fleet_leases import Sighting

#: The application_name of a lease check's short connection.
LEASE_APPLICATION_NAME = "outboxkit-fleet:lease"

CREATE = (
    "CREATE TABLE IF NOT EXISTS outboxkit_fleet ("
    " service text NOT NULL, member text NOT NULL, expires_at timestamptz NOT NULL,"
    " owner boolean NOT NULL DEFAULT false, PRIMARY KEY (service, member))",
    "CREATE UNIQUE INDEX IF NOT EXISTS outboxkit_fleet_owner ON outboxkit_fleet (service)"
    " WHERE owner",
)
#: ``migrate --fleet`` and a first check: two CREATE ... IF NOT EXISTS at once can still
#: collide in the catalog.
CREATE_LOCK = "SELECT pg_advisory_xact_lock(hashtext('outboxkit_fleet:migrate'))"
EXISTS = "SELECT to_regclass('outboxkit_fleet') IS NOT NULL"
LOCK = "SELECT pg_advisory_xact_lock(hashtext('outboxkit_fleet:' || %(service)s))"
#: A process not seen for a lease is gone: its heartbeat and its ownership go with it.
EXPIRE = "DELETE FROM outboxkit_fleet WHERE service = %(service)s AND expires_at < now()"
HEARTBEAT = (
    "INSERT INTO outboxkit_fleet (service, member, expires_at)"
    " VALUES (%(service)s, %(member)s, now() + make_interval(secs => %(ttl)s))"
    " ON CONFLICT (service, member) DO UPDATE SET expires_at = EXCLUDED.expires_at"
)
TAKE = (
    "UPDATE outboxkit_fleet SET owner = true WHERE service = %(service)s"
    " AND member = %(member)s AND NOT EXISTS (SELECT 1 FROM outboxkit_fleet"
    " WHERE service = %(service)s AND owner AND member <> %(member)s)"
)
GIVE_UP = (
    "UPDATE outboxkit_fleet SET owner = false"
    " WHERE service = %(service)s AND member = %(member)s AND owner"
)
SEEN = "SELECT member, owner FROM outboxkit_fleet WHERE service = %(service)s"
LEAVE = "DELETE FROM outboxkit_fleet WHERE service = %(service)s AND member = %(member)s"
#: ``status``: the owner of a service and whether its lease still runs (no row: none).
OWNER = (
    "SELECT member, extract(epoch FROM expires_at - now()) FROM outboxkit_fleet"
    " WHERE service = %(service)s AND owner"
)


class PgFleetLease:
    """One fleet process's lease checks on one database."""

    def __init__(self, dsn: str, service: str, member: str, ttl: float) -> None:
        self.dsn = dsn
        self.params: dict[str, Any] = {"service": service, "member": member, "ttl": ttl}

    async def check(self, want: bool) -> Sighting:
        conn = await aconnect(self.dsn, application_name=LEASE_APPLICATION_NAME)
        try:
            try:
                return await self._check(conn, want)
            except pg_errors.UndefinedTable:
                async with conn.transaction():  # (processes' first checks at once)
                    await conn.execute(CREATE_LOCK)
                    for statement in CREATE:
                        await conn.execute(statement)
                return await self._check(conn, want)
        finally:
            await conn.close()

    async def _check(self, conn: psycopg.AsyncConnection[Any], want: bool) -> Sighting:
        async with conn.transaction():
            await conn.execute(LOCK, self.params)
            await conn.execute(EXPIRE, self.params)
            await conn.execute(HEARTBEAT, self.params)
            await conn.execute(TAKE if want else GIVE_UP, self.params)
            cur = await conn.execute(SEEN, self.params)
            rows = await cur.fetchall()
        owner = next((str(member) for member, owns in rows if owns), None)
        return Sighting(owner=owner, members=frozenset(str(member) for member, _ in rows))

    async def leave(self) -> None:
        conn = await aconnect(self.dsn, application_name=LEASE_APPLICATION_NAME)
        try:
            await conn.execute(LEAVE, self.params)
        except pg_errors.UndefinedTable:
            pass
        finally:
            await conn.close()


def create_table(conn: psycopg.Connection[Any]) -> bool:
    """Create the lease table and its index if missing (``migrate --fleet``); True if the
    table was missing. Idempotent, and serialised by an advisory lock."""
    with conn.transaction():
        conn.execute(CREATE_LOCK)
        row = conn.execute(EXISTS).fetchone()
        for statement in CREATE:
            conn.execute(statement)
    return not (row and row[0])


def lease_owner(conn: psycopg.Connection[Any], service: str) -> tuple[str, float] | None:
    """The member serving ``service`` and the seconds left of its lease (``status``)."""
    try:
        with conn.transaction():
            row = conn.execute(OWNER, {"service": service}).fetchone()
    except pg_errors.UndefinedTable:
        return None
    return (str(row[0]), float(row[1])) if row else None
