"""What PostgreSQL's two queue stores share below their SQL: sessions, wake-ups, the pooler.

backends/postgres/queue_pg.py (the outbox) and backends/postgres/tasks_pg.py (task mode) run their
own statements; both need the same connections by role (``claim``, ``settle``, and ``direct_dsn``'s
for the session locks), the wake-up gate (a session advisory lock: writers NOTIFY only while it is
held), a LISTEN connection kept alive, the rules for a transaction pooler (no session state: no gate
and no LISTEN on it), and psycopg's errors turned into the store interface's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import orjson
import psycopg
from psycopg import sql
from psycopg.types.json import set_json_loads

from outboxkit._backoff import Backoff
from outboxkit._text import first_line
from outboxkit.backends.postgres._connection import PoolerMode, aconnect, known_pooling
from outboxkit.errors import ConfigurationError, connection_lost, write_denied
from outboxkit.queue.store import StoreDenied, StoreError, StoreTimeout, StoreUnavailable

Role = Literal["claim", "settle"]

#: The LISTEN connection is asked a question (``SELECT 1``) this often, and given this long
#: to answer before it is taken for dead and replaced (docs/tasks.md, "Listener health").
LISTEN_CHECK_INTERVAL = 10.0
LISTEN_CHECK_TIMEOUT = 5.0

#: A claim, settle, heartbeat or wake-up gate round trip not answered within this share of
#: the lease is taken for a dead connection: it is hung up and the loop reconnects (None:
#: wait forever). A third: a settle starts with at least two thirds of its lease left (the
#: heartbeat extends it every third), so a hung one is found and retried on a new
#: connection before the lease runs out; the retry is safe whether or not the lost one
#: committed (the claim token fences it). 10 s at the default lease, where these statements
#: take milliseconds: a database that needs longer for one claim is already breaking the
#: lease's promise, and hanging up costs one reconnect (the claimed rows come back at
#: lease expiry).
ANSWER_SHARE: float | None = 1 / 3
#: ... but never less than this: a lease of a few seconds must not turn a busy moment into
#: a hang-up (below a 3 s lease a hung settle may then outlive its lease: the fence keeps
#: that safe, the rows are published again, not lost).
MIN_ANSWER_WITHIN = 1.0
#: A settle connection not asked anything for this long is closed (the next settle opens
#: one): a database with nothing to publish then holds its claim and LISTEN connections
#: only, which counts in a fleet of many mostly idle databases (docs/fleet.md).
SETTLE_IDLE = float(os.environ.get("OUTBOXKIT_SETTLE_IDLE", "30"))
#: The lease the bound is taken from until the first claim tells (the Relay's default).
DEFAULT_LEASE = 30.0
#: libpq's TCP keepalives and TCP_USER_TIMEOUT on the claim, settle and gate connections
#: (where the DSN sets none): the kernel then drops a connection whose peer vanished (about
#: 30 s idle, 30 s of unacknowledged data). Not enough alone: a proxy or a pooler on the
#: path answers keepalives and acknowledges data for a server that is gone, hence the
#: deadline above.
TCP_OPTIONS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 15,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,  # (milliseconds)
}

_R = TypeVar("_R")


class PgSession:
    """Connections, the wake-up gate and LISTEN of a queue store on PostgreSQL.

    ``who`` and ``what`` name the process and its items in log lines ("relay", "events").
    ``channel`` is the table's NOTIFY channel; ``try_wake_lock`` and ``wake_unlock`` its
    gate's statements (the subclass's SQL). ``listen_check``: (interval, timeout) of the
    LISTEN connection's health probe (:meth:`listen`). ``lease``: the last one used; a
    round trip on a claim, settle or gate connection gets :attr:`answer_within` of it.
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
        self.listen_check = (LISTEN_CHECK_INTERVAL, LISTEN_CHECK_TIMEOUT)
        self.lease = DEFAULT_LEASE  # (the last claim's or heartbeat's: the deadline's base)
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
        # One connect per role at a time: two settles at a relay's first batches both found
        # no settle connection and both opened one; the first was dropped, open until
        # collected (an extra server connection per store, seen counting a fleet's).
        self._connecting = {"claim": asyncio.Lock(), "settle": asyncio.Lock()}
        self._told_pooled = False
        self._settle_used = 0.0  # (the loop's clock at the last settle)
        self._settle_timer: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Future[None]] = set()

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
            row = await self.within(conn, "wake-up gate", _fetchone(conn, self._try_wake_lock))
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
            await self.within(conn, "wake-up gate", conn.execute(self._wake_unlock))
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

        A LISTEN connection can die without a word: its backend terminated while nothing
        is read, or a network path that stops forwarding without closing (a proxy, a
        load balancer or a NAT that lost the connection, a server that hangs). So it is
        asked ``SELECT 1`` every ``listen_check[0]`` seconds; no answer within
        ``listen_check[1]`` and it is hung up and replaced. TCP keepalives would not do:
        whatever sits next on the path answers them (the proxy, the pooler), not the
        backend that holds the LISTEN. One warning when it breaks, one line when it is back.
        """
        backoff = Backoff(base=0.5, cap=10.0)
        channel = sql.Identifier(self._channel)
        dsn = self.direct_dsn or self.dsn
        broken = False
        while True:
            try:
                async with await aconnect(
                    dsn, application_name=f"{self.name}:listen", pooler=self._pooler_of(dsn)
                ) as conn:
                    if not self._listenable(dsn):
                        return
                    await conn.execute(sql.SQL("LISTEN {}").format(channel))
                    backoff.reset()
                    if broken:
                        broken = False
                        self._log.info("the %s's LISTEN connection is back", self._who)
                    wake()  # anything committed while we were not listening
                    await self._pass_on(conn, wake)
                why = f"it did not answer within {self.listen_check[1]:g}s"
            except psycopg.OperationalError as exc:
                why = first_line(exc)
            delay = backoff.next_delay()
            if not broken:
                broken = True
                self._log.warning(
                    "the %s's LISTEN connection is lost (%s): %s are found by the poll until"
                    " it is replaced",
                    self._who,
                    why,
                    self._what,
                )
            self._log.debug("LISTEN connection lost (%s); retrying in %.2fs", why, delay)
            await asyncio.sleep(delay)

    async def _pass_on(self, conn: psycopg.AsyncConnection[Any], wake: Callable[[], None]) -> None:
        """Call ``wake`` for every notification until ``conn`` stops answering (then return)
        or breaks (OperationalError). Notifications that come during a probe are kept by
        psycopg and passed on after it."""
        interval, timeout = self.listen_check
        while True:
            async for _notify in conn.notifies(timeout=interval):
                wake()
            if not await _answers(conn, timeout):
                return

    # -- connections ----------------------------------------------------------------------------

    #: Plan the claim and settle statements once per connection (a generic plan), not at
    #: every execution: PostgreSQL kept re-planning the task claim with its parameters
    #: (custom plans, about 0.5 ms a claim, more than running it). Only where the session
    #: keeps state: behind a transaction pooler the SET would reach other clients.
    generic_plans = False

    def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Set up a new claim or settle connection (loaders): JSON by orjson."""
        set_json_loads(orjson.loads, conn)

    async def _connection(self, role: Role) -> psycopg.AsyncConnection[Any]:
        if role == "settle":
            self._settle_used = asyncio.get_running_loop().time()
            if self._settle_timer is None:
                self._arm_settle_timer(SETTLE_IDLE)
        conn = self._claim_conn if role == "claim" else self._settle_conn
        if conn is not None and not conn.closed:
            return conn
        async with self._connecting[role]:
            conn = self._claim_conn if role == "claim" else self._settle_conn
            if conn is not None and not conn.closed:
                return conn  # (another caller connected while this one waited)
            return await self._connect(role)

    async def _connect(self, role: Role) -> psycopg.AsyncConnection[Any]:
        conn = await aconnect(
            self.dsn, application_name=f"{self.name}:{role}", pooler=self.pooler, libpq=TCP_OPTIONS
        )
        self._configure(conn)
        if self.generic_plans and self.session_state:
            try:
                await conn.execute("SET plan_cache_mode = force_generic_plan")
            except BaseException:
                await conn.close()
                raise
        if role == "claim":
            self._claim_conn = conn
        else:
            self._settle_conn = conn
        return conn

    def _arm_settle_timer(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        self._settle_timer = loop.call_later(delay, self._settle_idle)

    def _settle_idle(self) -> None:
        """Close the settle connection once nothing used it for :data:`SETTLE_IDLE`."""
        self._settle_timer = None
        conn = self._settle_conn
        if conn is None or conn.closed:
            return
        idle = asyncio.get_running_loop().time() - self._settle_used
        busy = conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE
        if idle < SETTLE_IDLE or busy:
            self._arm_settle_timer(max(SETTLE_IDLE - idle, 0.1))
            return
        self._settle_conn = None
        closing = asyncio.ensure_future(conn.close())
        self._closing.add(closing)  # (a task only weakly held by the loop)
        closing.add_done_callback(self._closing.discard)

    async def _direct(self) -> psycopg.AsyncConnection[Any]:
        """The connection to ``direct_dsn`` that holds the wake-up gate's lock."""
        conn = self._direct_conn
        if conn is not None and not conn.closed:
            return conn
        assert self.direct_dsn is not None
        conn = await aconnect(
            self.direct_dsn, application_name=f"{self.name}:gate", libpq=TCP_OPTIONS
        )
        pooling = known_pooling(self.direct_dsn)
        if pooling is not None and not pooling.session_state:
            await conn.close()
            raise _direct_pooled()
        self._direct_conn = conn
        return conn

    @property
    def answer_within(self) -> float | None:
        """Seconds a round trip may wait for its answer (a share of the lease), or None."""
        if ANSWER_SHARE is None:
            return None
        return max(self.lease * ANSWER_SHARE, MIN_ANSWER_WITHIN)

    async def within(
        self, conn: psycopg.AsyncConnection[Any], what: str, work: Awaitable[_R]
    ) -> _R:
        """``work`` (round trips on ``conn``), unless no answer comes within
        :attr:`answer_within`: then ``conn`` is hung up and StoreUnavailable raised.

        A connection whose path turned into a black hole (a failover, a NAT or firewall that
        dropped its state) never answers nor fails: the claim loop would wait forever,
        silently. Not cancelled: psycopg would send a cancel and then wait for the answer on
        the same silent path; a socket shut down ends the wait at once (with an error).
        """
        bound = self.answer_within
        if bound is None:
            return await work
        fired: list[bool] = []  # (a timer, not a task per round trip: the claim's hot path)
        timer = asyncio.get_running_loop().call_later(bound, _hang_up_late, conn, fired)
        try:
            return await work
        except psycopg.Error as exc:
            if not fired:
                raise
            with contextlib.suppress(Exception):
                await conn.close()
            message = (
                f"the database did not answer the {what} within {bound:g}s"
                f" (lease {self.lease:g}s): its connection was hung up"
            )
            raise StoreUnavailable(message, cause=psycopg.OperationalError(message)) from exc
        finally:
            timer.cancel()

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
        if self._settle_timer is not None:
            self._settle_timer.cancel()
            self._settle_timer = None
        for conn in (self._claim_conn, self._settle_conn, self._direct_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._claim_conn = self._settle_conn = self._gate_conn = self._direct_conn = None


async def _answers(conn: psycopg.AsyncConnection[Any], within: float) -> bool:
    """Whether ``conn``'s backend answers ``SELECT 1`` ``within`` seconds; if not,
    the connection is hung up. OperationalError if it is already known to be broken."""
    probe = asyncio.ensure_future(conn.execute("SELECT 1"))
    try:
        done, _ = await asyncio.wait({probe}, timeout=within)
    finally:
        if not probe.done():
            # Not cancelled: psycopg would send a cancel request and wait on the same
            # silent path. A socket shut down ends the probe at once with a broken connection.
            _hang_up(conn)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(probe), timeout=within)
        elif not probe.cancelled():
            probe.exception()  # (retrieved: raised below, or dropped with a cancellation)
    if done:
        await probe  # (its error, if any)
        return True
    return False


async def _fetchone(conn: psycopg.AsyncConnection[Any], statement: str) -> Any:
    cur = await conn.execute(statement)
    return await cur.fetchone()


async def fetch_rows(cur: psycopg.AsyncCursor[Any], statement: str, params: Any) -> list[Any]:
    """``statement``'s rows: its round trips as one awaitable, for :meth:`PgSession.within`."""
    await cur.execute(statement, params)
    return await cur.fetchall()


def _hang_up_late(conn: psycopg.AsyncConnection[Any], fired: list[bool]) -> None:
    fired.append(True)
    _hang_up(conn)


def _hang_up(conn: psycopg.AsyncConnection[Any]) -> None:
    """Shut ``conn``'s socket down (both ways) without closing it: the waits on it end."""
    with contextlib.suppress(Exception), socket.socket(fileno=os.dup(conn.pgconn.socket)) as s:
        s.shutdown(socket.SHUT_RDWR)


def _direct_pooled() -> ConfigurationError:
    return ConfigurationError(
        "--direct-dsn goes through a transaction pooler too: it must reach PostgreSQL itself"
        " (the LISTEN connection and the session locks need a session of their own)"
    )
