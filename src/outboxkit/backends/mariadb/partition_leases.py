"""MariaDB/MySQL's statements on ordered mode's lease tables (the port of
queue/partition_leases.py), on aiomysql.

The assignment, draining and hand-over logic is the core's (queue/partition_leases.py);
this module only runs its statements (backends/mariadb/ordered_sql.py). The relay-id guard is a
named lock (``GET_LOCK``) held by the heartbeat's session for the relay's life: session-scoped is
what it needs (a reconnect takes it again, or is refused if another process has it)."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

from outboxkit.backends.mariadb.ordered_sql import OrderedStatements, expand
from outboxkit.backends.mariadb.session import quiet_cursor
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.queue.partition_leases import duplicate_relay_id, not_ordered

_NO_TABLE = 1146


def _micros(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))


class MariaDBLeaseTable:
    """One ordered relay's statements on a MariaDB outbox's lease tables."""

    def __init__(self, dsn: str, table: str, relay_id: str, lease: float) -> None:
        import pymysql

        self.dsn = dsn
        self.relay_id = relay_id
        self.lease = lease
        self.sql = OrderedStatements(table)
        self.table = table
        self.errors: tuple[type[Exception], ...] = (pymysql.err.MySQLError, OSError)
        self._my: Any = None

    async def _db(self, *, lock: bool = True) -> Any:
        """The heartbeat's connection, holding the relay-id lock unless ``lock`` is False
        (the goodbye at shutdown: the lock went with the old connection)."""
        if self._my is not None and not self._my.closed:
            return self._my
        import aiomysql

        args = connect_args(self.dsn)
        args["db"] = args.pop("database")
        conn = await aiomysql.connect(
            **args, autocommit=True, connect_timeout=10, cursorclass=quiet_cursor()
        )
        if not lock:
            self._my = conn
            return conn
        try:
            name = hashlib.sha256(f"outboxkit relay id {self.table} {self.relay_id}".encode())
            async with conn.cursor() as cur:
                await cur.execute(self.sql.relay_id_lock, (f"outboxkit:{name.hexdigest()[:40]}",))
                (got,) = await cur.fetchone()
            if not got:
                raise duplicate_relay_id(self.relay_id, self.table)
        except BaseException:
            conn.close()
            raise
        self._my = conn
        return conn

    async def _rows(self, *statements: tuple[str, tuple[Any, ...]], lock: bool = True) -> list[Any]:
        """Run ``statements`` one after the other (each its own autocommit transaction:
        one transaction holding the upsert and the purge of the relays table deadlocked
        between two relays); the last one's rows."""
        conn = await self._db(lock=lock)
        async with conn.cursor() as cur:
            for statement, params in statements:
                await cur.execute(statement, params)
            return list(await cur.fetchall())

    async def check_schema(self) -> None:
        import pymysql

        try:
            rows = await self._rows((self.sql.partition_count, ()))
        except pymysql.err.ProgrammingError as exc:
            if exc.args and exc.args[0] == _NO_TABLE:
                raise not_ordered(self.table) from None
            raise
        if not rows or not rows[0][0]:
            raise not_ordered(self.table)

    async def partition_count(self) -> int:
        rows = await self._rows((self.sql.partition_count, ()))
        return int(rows[0][0])

    async def heartbeat(self) -> tuple[str, ...]:
        lease = _micros(self.lease)
        rows = await self._rows(
            (self.sql.relay_beat, (self.relay_id, lease)),
            (self.sql.forget_relays, (10 * lease,)),
            (self.sql.live_relays, ()),
        )
        return tuple(r[0] for r in rows)

    async def release(self, parts: list[int]) -> None:
        statement = expand(self.sql.release_partitions, parts=len(parts))
        await self._rows((statement, (*parts, self.relay_id)))

    async def acquire(self, wanted: list[int]) -> frozenset[int]:
        if not wanted:
            return frozenset()
        me, n = self.relay_id, len(wanted)
        rows = await self._rows(
            (
                expand(self.sql.acquire_partitions, parts=n),
                (me, me, _micros(self.lease), *wanted, me),
            ),
            (expand(self.sql.held_partitions, parts=n), (*wanted, me)),
        )
        return frozenset(int(r[0]) for r in rows)

    async def give_back(self, parts: list[int]) -> None:
        leave = (self.sql.leave, (self.relay_id,))
        if parts:
            release = expand(self.sql.release_partitions, parts=len(parts))
            await self._rows((release, (*parts, self.relay_id)), leave, lock=False)
        else:
            await self._rows(leave, lock=False)

    async def drop_connection(self) -> None:
        conn, self._my = self._my, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    async def close(self) -> None:
        await self.drop_connection()  # (the relay-id lock is the session's: it goes with it)
