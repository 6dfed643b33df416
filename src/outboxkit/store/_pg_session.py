"""What PostgreSQL's two queue stores share below their SQL: sessions, wake-ups, the pooler.

store/queue_pg.py (the outbox) and store/tasks_pg.py (task mode) run their own statements;
both need the same connections by role (``claim``, ``settle``, and ``direct_dsn``'s for the
session locks), the wake-up gate (a session advisory lock: writers NOTIFY only while it is
held), a LISTEN connection kept alive, the rules for a transaction pooler (no session state:
no gate and no LISTEN on it), and psycopg's errors turned into the store interface's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Literal

import orjson
import psycopg
from psycopg import sql
from psycopg.types.json import set_json_loads

from outboxkit._backoff import Backoff
from outboxkit._text import first_line
from outboxkit.errors import ConfigurationError, connection_lost, write_denied
from outboxkit.queue.store import StoreDenied, StoreError, StoreTimeout, StoreUnavailable
from outboxkit.store._connection import PoolerMode, aconnect, known_pooling

Role = Literal["claim", "settle"]


class PgSession:
    """Connections, the wake-up gate and LISTEN of a queue store on PostgreSQL.

    ``who`` and ``what`` name the process and its items in log lines ("relay", "events").
    ``channel`` is the table's NOTIFY channel; ``try_wake_lock`` and ``wake_unlock`` its
    gate's statements (the subclass's SQL).
    """

    def __init__(
        self,
        dsn: str,
        *,
        name: str,
        pooler: PoolerMode | None,
        direct_dsn: str | None,
        channel: str,
        try_wake_lock: str,
        wake_unlock: str,
        log: logging.Logger,
        who: str,
        what: str,
    ) -> None:
        self.dsn = dsn
        self.pooler = pooler
        self.direct_dsn = direct_dsn
        self.name = name
        self._channel = channel
        self._try_wake_lock = try_wake_lock
        self._wake_unlock = wake_unlock
        self._log = log
        self._who = who
        self._what = what
        self._claim_conn: psycopg.AsyncConnection[Any] | None = None
        self._settle_conn: psycopg.AsyncConnection[Any] | None = None
        self._gate_conn: psycopg.AsyncConnection[Any] | None = None
        self._direct_conn: psycopg.AsyncConnection[Any] | None = None
        self._told_pooled = False

    # -- the pooler ---------------------------------------------------------------------

    @property
    def session_state(self) -> bool:
        """Whether the claim connection keeps session state (not behind a transaction pooler;
        unknown before the first connection: assumed)."""
        pooling = known_pooling(self.dsn, self.pooler)
        return pooling is None or pooling.session_state

    def _tell_pooled(self) -> None:
        if not self._told_pooled:
            self._told_pooled = True
            self._log.warning(
                "the %s's database connection goes through a transaction pooler: no LISTEN"
                " and no wake-up gate (they need a session), so %s are found by the poll"
                " (--poll-interval); give --direct-dsn (PostgreSQL itself, not the pooler)"
                " for wake-ups within milliseconds",
                self._who,
                self._what,
            )

    def _pooler_of(self, dsn: str) -> PoolerMode | None:
        """The ``pooler`` override applies to the store's DSN, not to its direct one."""
        return self.pooler if dsn is self.dsn else None

    def _listenable(self, dsn: str) -> bool:
        pooling = known_pooling(dsn, self._pooler_of(dsn))
        if pooling is None or pooling.session_state:
            return True
        if dsn is self.dsn:
            self._tell_pooled()
            return False
        raise _direct_pooled()

    # -- the wake-up gate -------------------------------------------------------------------

    @property
    def gate_closed(self) -> bool:
        gate = self._gate_conn
        owner = self._claim_conn if self.direct_dsn is None else self._direct_conn
        if gate is not None and (gate is not owner or gate.closed):
            self._gate_conn = None  # its connection was replaced: the lock went with it
        return self._gate_conn is not None

    async def close_gate(self) -> bool:
        """Take the wake-up gate's lock: from now on writers notify. False if held elsewhere.

        The lock is a session's: it is taken on ``direct_dsn`` when given, and never
        through a transaction pooler (it would stay on whichever server connection ran it).
        """
        try:
            if self.direct_dsn is not None:
                conn = await self._direct()
            else:
                conn = await self._connection("claim")
                if not self.session_state:
                    self._tell_pooled()
                    return False
            cur = await conn.execute(self._try_wake_lock)
            row = await cur.fetchone()
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc
        if row is None or not row[0]:
            return False
        self._gate_conn = conn
        return True

    async def open_gate(self) -> None:
        """Release the wake-up gate's lock: writers stop notifying while the store's user works."""
        conn, self._gate_conn = self._gate_conn, None
        owner = self._claim_conn if self.direct_dsn is None else self._direct_conn
        if conn is None or conn.closed or conn is not owner:
            return
        try:
            await conn.execute(self._wake_unlock)
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc

    # -- LISTEN -------------------------------------------------------------------------------

    @property
    def can_listen(self) -> bool:
        if self.direct_dsn is not None or self.session_state:
            return True
        self._tell_pooled()  # once: the loop polls from here on
        return False

    async def listen(self, wake: Callable[[], None]) -> None:
        """Wake the claim loop on NOTIFY. Polling still runs: notifications are not durable.

        LISTEN needs a session: it runs on ``direct_dsn`` when given, and returns at once
        (the poll remains) when its connection turns out to go through a transaction pooler.
        """
        backoff = Backoff(base=0.5, cap=10.0)
        channel = sql.Identifier(self._channel)
        dsn = self.direct_dsn or self.dsn
        while True:
            try:
                async with await aconnect(
                    dsn, application_name=f"{self.name}:listen", pooler=self._pooler_of(dsn)
                ) as conn:
                    if not self._listenable(dsn):
                        return
                    await conn.execute(sql.SQL("LISTEN {}").format(channel))
                    backoff.reset()
                    wake()  # anything committed while we were not listening
                    async for _notify in conn.notifies():
                        wake()
            except psycopg.OperationalError as exc:
                delay = backoff.next_delay()
                self._log.debug(
                    "LISTEN connection lost (%s); retrying in %.2fs", first_line(exc), delay
                )
                await asyncio.sleep(delay)

    # -- connections ----------------------------------------------------------------------------

    def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Set up a new claim or settle connection (loaders): JSON by orjson."""
        set_json_loads(orjson.loads, conn)

    async def _connection(self, role: Role) -> psycopg.AsyncConnection[Any]:
        conn = self._claim_conn if role == "claim" else self._settle_conn
        if conn is not None and not conn.closed:
            return conn
        conn = await aconnect(self.dsn, application_name=f"{self.name}:{role}", pooler=self.pooler)
        self._configure(conn)
        if role == "claim":
            self._claim_conn = conn
        else:
            self._settle_conn = conn
        return conn

    async def _direct(self) -> psycopg.AsyncConnection[Any]:
        """The connection to ``direct_dsn`` that holds the wake-up gate's lock."""
        conn = self._direct_conn
        if conn is not None and not conn.closed:
            return conn
        assert self.direct_dsn is not None
        conn = await aconnect(self.direct_dsn, application_name=f"{self.name}:gate")
        pooling = known_pooling(self.direct_dsn)
        if pooling is not None and not pooling.session_state:
            await conn.close()
            raise _direct_pooled()
        self._direct_conn = conn
        return conn

    async def _translate(self, exc: psycopg.Error) -> StoreError:
        """``exc`` as the store interface's error; broken connections are dropped."""
        if write_denied(exc):
            return StoreDenied(first_line(exc, with_type=True), cause=exc)
        if connection_lost(exc):
            for conn in (self._claim_conn, self._settle_conn, self._direct_conn):
                if conn is not None and conn.broken:
                    with contextlib.suppress(Exception):
                        await conn.close()
            return StoreUnavailable(first_line(exc, with_type=True), cause=exc)
        if isinstance(exc, psycopg.OperationalError):
            return StoreTimeout(first_line(exc, with_type=True), cause=exc)
        return StoreError(first_line(exc, with_type=True), cause=exc)

    async def close(self) -> None:
        for conn in (self._claim_conn, self._settle_conn, self._direct_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._claim_conn = self._settle_conn = self._gate_conn = self._direct_conn = None


def _direct_pooled() -> ConfigurationError:
    return ConfigurationError(
        "--direct-dsn goes through a transaction pooler too: it must reach PostgreSQL itself"
        " (the LISTEN connection and the session locks need a session of their own)"
    )
