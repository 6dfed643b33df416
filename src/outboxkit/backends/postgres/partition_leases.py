"""PostgreSQL's statements on ordered mode's lease tables (the port of
queue/partition_leases.py), on one autocommit connection.

The heartbeat's statements are single autocommit statements, fine through a transaction
pooler; the relay-id lock (a session advisory lock held for the relay's life) is not: it
is taken on the direct DSN when given, skipped for a generated relay id (unique by
construction), and an explicit ``--relay-id`` behind a transaction pooler without a direct
DSN is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from outboxkit.backends.postgres._connection import PoolerMode, aconnect, known_pooling
from outboxkit.backends.postgres.ordered_sql import OrderedStatements
from outboxkit.errors import ConfigurationError
from outboxkit.queue.partition_leases import duplicate_relay_id, not_ordered


class PgLeaseTable:
    """One relay's statements on an outbox's lease tables, and its relay-id lock."""

    def __init__(
        self,
        dsn: str,
        table: str,
        relay_id: str,
        lease: float,
        *,
        pooler: PoolerMode | None = None,
        direct_dsn: str | None = None,
        unique_id: bool = False,
    ) -> None:
        self.dsn = dsn
        self.stmts = OrderedStatements(table)
        self.relay_id = relay_id
        self.lease = lease
        self.pooler = pooler
        self.direct_dsn = direct_dsn
        self.unique_id = unique_id
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock_conn: psycopg.AsyncConnection[Any] | None = None  # on direct_dsn

    async def check_schema(self) -> None:
        conn = await self._connection()
        try:
            cur = await conn.execute(self.stmts.partition_count)
            row = await cur.fetchone()
        except (pg_errors.UndefinedTable, pg_errors.UndefinedColumn):
            raise not_ordered(self.stmts.table) from None
        if not row or not row[0]:
            raise not_ordered(self.stmts.table)

    #: What a failed heartbeat statement raises (retried with backoff).
    errors: tuple[type[Exception], ...] = (psycopg.Error,)

    async def partition_count(self) -> int:
        cur = await (await self._connection()).execute(self.stmts.partition_count)
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def heartbeat(self) -> tuple[str, ...]:
        params = {"relay_id": self.relay_id, "lease": self.lease}
        cur = await (await self._connection()).execute(self.stmts.relay_heartbeat, params)
        return tuple(r[0] for r in await cur.fetchall())

    async def release(self, parts: list[int]) -> None:
        params = {"relay_id": self.relay_id, "parts": parts}
        await (await self._connection()).execute(self.stmts.release_partitions, params)

    async def acquire(self, wanted: list[int]) -> frozenset[int]:
        params = {"relay_id": self.relay_id, "lease": self.lease, "wanted": wanted}
        cur = await (await self._connection()).execute(self.stmts.acquire_partitions, params)
        return frozenset(int(r[0]) for r in await cur.fetchall())

    async def give_back(self, parts: list[int]) -> None:
        """Release ``parts`` and leave the membership (at shutdown)."""
        conn = await self._connection()
        params = {"relay_id": self.relay_id, "parts": parts}
        await conn.execute(self.stmts.release_partitions, params)
        await conn.execute(self.stmts.leave, params)

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            conn = await aconnect(
                self.dsn, application_name="outboxkit-relay:partition-leases", pooler=self.pooler
            )
            try:
                await self._hold_id_lock(conn)
            except BaseException:
                await conn.close()
                raise
            self._conn = conn
        return self._conn

    async def _hold_id_lock(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Hold the relay-id lock (a session's) for as long as this relay runs.

        On ``conn`` itself when it keeps its session; on a connection to ``direct_dsn``
        when given; behind a transaction pooler without one, a generated id needs no lock
        and an explicit one is refused (the lock would stay on a pooled server connection).
        """
        if self.direct_dsn is not None:
            if self._lock_conn is not None and not self._lock_conn.closed:
                return
            lock = await aconnect(self.direct_dsn, application_name="outboxkit-relay:relay-id")
            pooling = known_pooling(self.direct_dsn)
            if pooling is not None and not pooling.session_state:
                await lock.close()
                raise ConfigurationError(
                    "--direct-dsn goes through a transaction pooler too: it must reach"
                    " PostgreSQL itself (ordered mode's relay-id lock needs a session)"
                )
            try:
                await self._try_id_lock(lock)
            except BaseException:
                await lock.close()
                raise
            self._lock_conn = lock
            return
        pooling = known_pooling(self.dsn, self.pooler)
        if pooling is not None and not pooling.session_state:
            if self.unique_id:
                return  # host-pid-random: no other process has it
            raise ConfigurationError(
                f"ordered relay {self.relay_id!r}: an explicit --relay-id is guarded by a"
                " session advisory lock, which a transaction pooler cannot hold; give"
                " --direct-dsn (PostgreSQL itself) for the lock, or leave --relay-id out"
                " (the default, host-pid-random, is unique)"
            )
        await self._try_id_lock(conn)

    async def _try_id_lock(self, conn: psycopg.AsyncConnection[Any]) -> None:
        cur = await conn.execute(self.stmts.relay_id_lock, {"relay_id": self.relay_id})
        row = await cur.fetchone()
        if not row or not row[0]:
            raise duplicate_relay_id(self.relay_id, self.stmts.table)

    async def drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def close(self) -> None:
        await self.drop_connection()
        lock, self._lock_conn = self._lock_conn, None
        if lock is not None:
            with contextlib.suppress(Exception):
                await lock.close()
