"""The MariaDB stores' connections: one aiomysql connection per role, errors as the core's.

Shared by the outbox's queue store (queue.py), task mode's (tasks.py) and the periodic
slots (schedules.py); the two stores are woken through :class:`GatedSession`. Each role (claim,
settle) has its own autocommit connection in READ COMMITTED (MariaDB's default REPEATABLE
READ would let a claim's snapshot miss rows committed after it) with ``CLIENT.FOUND_ROWS``
(an UPDATE's row count is the rows it matched, as on PostgreSQL), used one statement or one
short transaction at a time; a server error becomes the StoreError the claim loop acts on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from outboxkit.backends.mariadb import sql, wakeup
from outboxkit.errors import ConfigurationError
from outboxkit.queue.idle import SETTLE_IDLE, IdleTimer
from outboxkit.queue.store import (
    StoreDenied,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)

#: Server error codes, by what the core does about them.
_LOST = {2003, 2006, 2013, 2055, 1053, 1927}  # no server, gone away, lost, shutdown, killed
_TIMEOUT = {1205, 1213, 1969, 3024}  # lock wait timeout, deadlock, statement timeouts
_DENIED = {1142, 1143, 1044, 1045, 1290, 1792}  # no privilege, read-only
NO_TABLE = 1146
NO_COLUMN = 1054
NO_INDEX = 1176  # a FORCE INDEX names an index the table lacks (a schema behind the code)
UNKNOWN_VARIABLE = 1193  # MySQL has no idle_transaction_timeout

#: A store's transactions are a few statements sent back to back. A process frozen between
#: two of them (SIGSTOP, a paused VM) would keep the rows it locked from every other worker's
#: SKIP LOCKED for as long as the server keeps its connection (``wait_timeout``: 8 hours by
#: default); MariaDB ends a transaction left idle this many seconds, connection and locks.
IDLE_TRANSACTION_TIMEOUT = 30


@contextlib.asynccontextmanager
async def atransaction(dsn: str) -> AsyncIterator[Any]:
    """A new aiomysql connection in a transaction: committed at the end of the block, rolled
    back on an exception, closed after (``Backend.atransaction``)."""
    try:
        import aiomysql
    except ImportError:
        raise ConfigurationError(
            "an async connection to MariaDB/MySQL needs aiomysql: pip install 'outboxkit[mysql]'"
        ) from None
    args = sql.connect_args(dsn)
    args["db"] = args.pop("database")
    conn = await aiomysql.connect(
        **args, autocommit=False, connect_timeout=10, cursorclass=quiet_cursor()
    )
    try:
        await conn.begin()
        try:
            yield conn
        except BaseException:
            await conn.rollback()
            raise
        await conn.commit()
    finally:
        conn.close()


def quiet_cursor() -> type:
    """aiomysql's cursor minus its warnings: after a statement that left a note (an
    ``INSERT IGNORE`` of a periodic slot another worker took: the normal path) aiomysql asks
    ``SHOW WARNINGS`` (a round trip) and ``warnings.warn``s each, into the user's process.
    The drivers' aiomysql adapter does the same for a caller's connection (the layers keep
    the two apart; it is four lines)."""
    import aiomysql

    class QuietCursor(aiomysql.Cursor):  # type: ignore[misc]
        async def _show_warnings(self, conn: Any) -> None:
            return None

    return QuietCursor


def micros(seconds: float) -> int:
    """Seconds as the whole microseconds of an ``INTERVAL … MICROSECOND``."""
    return max(0, round(seconds * 1_000_000))


async def _limit_idle_transactions(cur: Any) -> None:
    import pymysql

    try:
        await cur.execute(f"SET SESSION idle_transaction_timeout = {IDLE_TRANSACTION_TIMEOUT}")
    except pymysql.err.MySQLError as exc:
        # MySQL has no such guard; MariaDB 10.3+ has it
        if not exc.args or exc.args[0] != UNKNOWN_VARIABLE:
            raise


class MariaDBSession:
    """A store's connections by role, and its errors translated (``_schema_error`` says what
    a missing table, column or index means for this store's table)."""

    what = "the relay"

    def __init__(self, dsn: str, roles: tuple[str, ...] = ("claim", "settle")) -> None:
        self.dsn = dsn
        self._args = sql.connect_args(dsn)
        self._conns: dict[str, Any] = {}
        self._locks = {role: asyncio.Lock() for role in roles}
        # An idle settle connection closes, as on PostgreSQL (queue/idle.py); the claim one
        # polls every --poll-interval, so it stays (a connect per poll would cost more).
        self._settle_idle = IdleTimer(SETTLE_IDLE if "settle" in roles else None, self._close_idle)
        self._closing: set[asyncio.Future[None]] = set()

    async def _connection(self, role: str) -> Any:
        conn = self._conns.get(role)
        if conn is not None and not conn.closed:
            return conn
        try:
            import aiomysql
            from pymysql.constants import CLIENT
        except ImportError:
            raise ConfigurationError(
                f"{self.what} on MariaDB/MySQL needs aiomysql and PyMySQL:"
                " pip install 'outboxkit[mysql]'"
            ) from None

        args = dict(self._args)
        args["db"] = args.pop("database")
        conn = await aiomysql.connect(
            **args,
            autocommit=True,
            client_flag=CLIENT.FOUND_ROWS,
            connect_timeout=10,
            cursorclass=quiet_cursor(),
        )
        async with conn.cursor() as cur:
            await cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            await _limit_idle_transactions(cur)
        self._conns[role] = conn
        return conn

    def _schema_error(self, code: int, reason: str) -> Exception | None:
        """The error to raise for a schema behind the code (a missing table, column or
        index), or None to report it as any other."""
        return None

    def _translate(self, role: str, exc: Exception) -> StoreError:
        code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        reason = str(exc.args[-1]) if exc.args else type(exc).__name__
        if code is None or code in _LOST or code >= 2000:
            conn = self._conns.pop(role, None)
            if conn is not None:
                conn.close()
            return StoreUnavailable(f"lost the MariaDB connection: {reason}", cause=exc)
        schema = self._schema_error(code, reason)
        if schema is not None:
            raise schema from None
        if code in _TIMEOUT:
            return StoreTimeout(f"MariaDB cancelled the statement: {reason}", cause=exc)
        if code in _DENIED:
            return StoreDenied(f"MariaDB refused the write: {reason}", cause=exc)
        return StoreError(f"MariaDB: {reason}", cause=exc)

    async def _run(self, role: str, work: Callable[[Any], Any]) -> Any:
        """Run ``work(cursor)`` on ``role``'s connection, one at a time; errors translated.

        A failed transaction is rolled back (a lost connection takes it with it).
        """
        import pymysql

        if role == "settle":
            self._settle_idle.used()
        async with self._locks[role]:
            try:
                conn = await self._connection(role)
                async with conn.cursor() as cur:
                    try:
                        return await work(cur)
                    except BaseException:
                        if not conn.closed:
                            await conn.rollback()
                        raise
            except (pymysql.err.MySQLError, OSError) as exc:
                raise self._translate(role, exc) from exc

    def _close_idle(self) -> float | None:
        """Close the settle connection once nothing used it for SETTLE_IDLE."""
        if self._locks["settle"].locked():
            return 0.1
        conn = self._conns.pop("settle", None)
        if conn is not None and not conn.closed:
            closing = asyncio.ensure_future(_quit(conn))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        return None

    def _close_connections(self) -> None:
        self._settle_idle.cancel()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


class GatedSession(MariaDBSession):
    """A store woken by outboxkit's writers of its table in this process (wakeup.py): no
    NOTIFY on MariaDB, so the claim loop's wake-up gate is the in-process one."""

    def __init__(self, dsn: str, table: str) -> None:
        super().__init__(dsn)
        self._gate = wakeup.Gate(table)

    async def close_gate(self) -> bool:
        return self._gate.close()

    async def open_gate(self) -> None:
        self._gate.open()

    @property
    def gate_closed(self) -> bool:
        return self._gate.closed

    @property
    def can_listen(self) -> bool:
        return True  # no NOTIFY: outboxkit's writers in this process wake the loop

    async def listen(self, wake: Callable[[], None]) -> None:
        """Be woken by this process's writers of the table until cancelled."""
        self._gate.listen(wake)
        try:
            wake()  # (as after LISTEN) what was committed before is claimed now
            await asyncio.Event().wait()
        finally:
            self._gate.stop_listening()

    async def close(self) -> None:
        self._gate.open()
        self._close_connections()


async def _quit(conn: Any) -> None:
    """Close ``conn`` saying goodbye (COM_QUIT: the server counts no aborted client)."""
    with contextlib.suppress(Exception):
        await conn.ensure_closed()
