"""What PostgreSQL's two queue stores share below their SQL: sessions, wake-ups, the pooler.

backends/postgres/queue_pg.py (the outbox) and backends/postgres/tasks_pg.py (task mode) run their
own statements; both need the same connections by role (``claim``, ``settle``, and ``direct_dsn``'s
for the session locks), the wake-up gate (a session advisory lock: writers NOTIFY only while it is
held), a LISTEN connection kept alive, the rules for a transaction pooler (no session state: no gate
and no LISTEN on it), and psycopg's errors turned into the store interface's.

Idle connections close: the settle one after :data:`SETTLE_IDLE`, and in a fleet
(outboxkit.queue.idle.claim_idle) the claim one too. A store whose claims found nothing that
long is *parked*: its claim connection closed, the wake-up gate's lock moved to its LISTEN
session, and each poll a one-row probe there (``due_in``: nothing, now, or in so many
seconds, then waited for with a timer) instead of a claim. A NOTIFY, a due row or a failed
probe unparks it: the claim connection opens again for the claim."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import orjson
import psycopg
from psycopg import sql
from psycopg.types.json import set_json_loads

from outboxkit._backoff import Backoff
from outboxkit._text import first_line
from outboxkit.backends.postgres._connection import PoolerMode, aconnect, known_pooling
from outboxkit.backends.postgres.postgres import LATER
from outboxkit.errors import ConfigurationError, connection_lost, write_denied
from outboxkit.queue.idle import SETTLE_IDLE, IdleTimer, claim_idle
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

#: A parked store claims this long after the time its probe said the first row is due.
DUE_MARGIN = 0.05

_R = TypeVar("_R")
_ListenWork = Callable[[psycopg.AsyncConnection[Any]], Awaitable[Any]]
_Woken = Callable[[str], None]  # (a notification's payload)


class PgSession:
    """Connections, the wake-up gate and LISTEN of a queue store on PostgreSQL.

    ``who`` and ``what`` name the process and its items in log lines ("relay", "events").
    ``channel`` is the table's NOTIFY channel; ``try_wake_lock`` and ``wake_unlock`` its
    gate's statements (the subclass's SQL); ``due_in`` the parked store's poll (seconds until
    the first item is due, NULL for none; None: the store never parks). ``listen_check``:
    (interval, timeout) of the LISTEN connection's health probe (:meth:`listen`). ``lease``:
    the last one used; a round trip on a claim, settle or gate connection gets
    :attr:`answer_within` of it.
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
        due_in: str | None = None,
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
        self._settle_idle = IdleTimer(SETTLE_IDLE, self._close_idle_settle)
        self._closing: set[asyncio.Future[None]] = set()
        # Parking (the module's docstring): the claim connection's timer (armed in a fleet),
        # the LISTEN session and the statements queued for it, the loop's wake-up.
        self._due_in = due_in
        self._due_params: Any = None  # (the probe's parameters: a task store's queues)
        self._claim_idle = IdleTimer(None, self._park_idle_claim)
        self._parked = False
        self._gate_moving = False  # (the lock between the claim connection and LISTEN's)
        self._woken = False  # a NOTIFY or a due row since the last claim: no probe
        self._due_timer: asyncio.TimerHandle | None = None
        self._wake: Callable[[], None] = _nothing
        self._listen_conn: psycopg.AsyncConnection[Any] | None = None
        self._listen_work: deque[tuple[str, _ListenWork, asyncio.Future[Any]]] = deque()
        self._pump: asyncio.Future[None] | None = None  # (the wait for notifications)
        self._listen_claims = False  # (set up to claim on: :meth:`_prepare_listen`)

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
        if self._gate_moving:
            return True  # (a parking store moves it to its LISTEN session)
        gate = self._gate_conn
        owner = self._claim_conn if self.direct_dsn is None else self._direct_conn
        if gate is not None and (
            gate.closed or (gate is not owner and gate is not self._listen_conn)
        ):
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
        if conn is not None and conn is self._listen_conn:  # (held there since parked)
            await self._on_listen("wake-up gate", lambda c: c.execute(self._wake_unlock))
            return
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
        self._wake = wake
        if self._due_in is not None and self.direct_dsn is None:
            self._claim_idle.seconds = claim_idle.get()  # (set in a fleet's service)

        def woken(payload: str) -> None:
            if payload == LATER:  # a row due later: a parked store probes for its time
                if self._parked:
                    wake()
                return
            self._woken = True  # (a parked store claims at once, without its probe)
            wake()

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
                    if self._claim_idle.seconds is not None:
                        self._listen_claims = await self._prepare_listen(conn)
                    self._listen_conn = conn
                    self._claim_idle.used()  # (parked only after a whole idle spell heard)
                    try:
                        await self._pass_on(conn, woken)
                    finally:
                        self._listen_lost(conn)
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

    async def _pass_on(self, conn: psycopg.AsyncConnection[Any], wake: _Woken) -> None:
        """Call ``wake`` for every notification until ``conn`` stops answering (then return)
        or breaks (OperationalError); run the statements queued for it (:meth:`_on_listen`)
        meanwhile. Notifications that come during a statement are kept by psycopg and passed
        on after it."""
        interval, timeout = self.listen_check
        while True:
            if not await self._notifications(conn, wake, interval):
                if not await self._serve_listen_work(conn):
                    return
            elif not await _answers(conn, timeout):
                return

    async def _notifications(
        self, conn: psycopg.AsyncConnection[Any], wake: _Woken, seconds: float
    ) -> bool:
        """Pass notifications on for ``seconds`` (True), or until a statement is queued for
        the session (False: the wait is cut short, psycopg keeps what arrives meanwhile)."""
        if self._listen_work:
            return False
        pump = self._pump = asyncio.ensure_future(_pump(conn, wake, seconds))
        try:
            await pump  # (cancelled by :meth:`_on_listen`)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # (the listener itself is cancelled)
            return False
        finally:
            self._pump = None
        return True

    async def _serve_listen_work(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Run the queued statements on ``conn``; False if it had to be hung up."""
        while self._listen_work:
            what, work, done = self._listen_work.popleft()
            if done.done():
                continue  # (its caller gave up)
            try:
                result = await self.within(conn, what, work(conn))
            except StoreUnavailable as exc:
                _settle(done, exc)
                return False
            except psycopg.Error as exc:
                _settle(done, exc)
                if conn.closed or conn.broken:
                    raise
            except BaseException as exc:
                _settle(done, StoreUnavailable(f"the {what} was interrupted"))
                raise exc
            else:
                if not done.done():  # (its caller may have given up meanwhile: a stop)
                    done.set_result(result)
        return True

    async def _on_listen(self, what: str, work: _ListenWork) -> Any:
        """``work`` run on the LISTEN session (between two waits for notifications).
        StoreUnavailable if there is none, or it breaks; psycopg's errors translated."""
        if self._listen_conn is None or self._listen_conn.closed:
            raise StoreUnavailable(f"no LISTEN session for the {what}")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._listen_work.append((what, work, done))
        if self._pump is not None:
            self._pump.cancel()
        try:
            return await done
        except psycopg.Error as exc:
            raise await self._translate(exc) from exc

    def _listen_lost(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The LISTEN session ended: its statements fail, and a parked store unparks (the
        gate's lock went with it): the loop claims on a claim connection again."""
        self._listen_conn = None
        self._listen_claims = False
        while self._listen_work:
            _what, _work, done = self._listen_work.popleft()
            if not done.done():
                done.set_exception(StoreUnavailable("the LISTEN session was lost"))
        if self._gate_conn is conn:
            self._gate_conn = None
        if self._parked:
            self._parked = False
            self._wake()

    # -- parking --------------------------------------------------------------------------------

    async def _prepare_listen(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Set a parking store's LISTEN connection up as a claim connection (its loaders,
        its session); True if the store's claims may then run on it (:meth:`_on_listen`)."""
        return False

    async def _claim_connection(self) -> psycopg.AsyncConnection[Any] | None:
        """The connection for a claim; None while parked with nothing due (the claim finds
        nothing without one). Unparking, the LISTEN connection when set up for claims
        (:meth:`_prepare_listen`), while the claim connection opens: the first item after an
        idle spell does not wait for a connect (measured 15-75 ms, bench/fleet_idle.py)."""
        woken, self._woken = self._woken, False
        if self._parked:
            if not woken and not await self._due():
                return None
            self._parked = False
            listen = self._listen_conn
            if self._listen_claims and listen is not None and not listen.closed:
                opening = asyncio.ensure_future(self._open_claim())
                self._closing.add(opening)  # (a task only weakly held by the loop)
                opening.add_done_callback(self._closing.discard)
                return listen
        return await self._connection("claim")

    async def _open_claim(self) -> None:
        """Open the claim connection (the loop's next claim reports a failure)."""
        with contextlib.suppress(Exception):
            await self._connection("claim")

    async def _due(self) -> bool:
        """A parked store's poll, on its LISTEN session: whether an item is claimable now. A
        later one is waited for with a timer; a failed probe says yes (the claim finds out)."""
        assert self._due_in is not None
        try:
            row = await self._on_listen(
                "poll", lambda c: _fetchone(c, self._due_in or "", self._due_params)
            )
        except StoreError:
            return True
        seconds = None if row is None else row[0]
        if seconds is None:
            return False
        if seconds <= 0:
            return True
        if self._due_timer is not None:
            self._due_timer.cancel()
        self._due_timer = asyncio.get_running_loop().call_later(
            seconds + DUE_MARGIN, self._wake_due
        )
        return False

    def _wake_due(self) -> None:
        """The time the probe said: probe again (not claim at once): the row may have moved
        since (a running task's lease extended by its heartbeat, a delayed row claimed)."""
        self._due_timer = None
        self._wake()

    def claimed_some(self) -> None:
        """A claim found items: the claim connection is in use (its idle timer restarts)."""
        self._claim_idle.used()

    def _park_idle_claim(self) -> float | None:
        """The claims found nothing for ``claim_idle`` seconds: park (the module's docstring).

        Only while this store holds the wake-up gate (on the claim connection, or its
        LISTEN session already): otherwise writers would not wake it. None: parked, or
        nothing to park; else the seconds after which to look again.
        """
        conn, listen = self._claim_conn, self._listen_conn
        if conn is None or conn.closed or self._parked:
            return None
        if listen is None or listen.closed or not self.session_state:
            return self._claim_idle.seconds  # (its LISTEN session may come back)
        if not self.gate_closed or self._gate_conn not in (conn, listen):
            return self._claim_idle.seconds
        if (
            conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE
            or conn.lock.locked()
        ):
            return 0.1  # (a claim under way)
        # No claim can start on it from here on: the next one opens a connection.
        self._claim_conn = None
        self._parked = True
        moving = self._gate_conn is conn
        self._gate_moving = moving
        parking = asyncio.ensure_future(self._park_claim(conn, moving))
        self._closing.add(parking)  # (a task only weakly held by the loop)
        parking.add_done_callback(self._closing.discard)
        return None

    async def _park_claim(self, conn: psycopg.AsyncConnection[Any], moving: bool) -> None:
        """Close the claim connection; move the gate's lock to the LISTEN session first.

        Released, then taken there: a writer that committed in between did not notify,
        so the loop is woken to poll once more (its probe sees that writer's row: the lock
        is taken only once no writer holds the gate's shared lock).
        """
        try:
            if moving:
                self._gate_conn = None
                with contextlib.suppress(psycopg.Error, StoreError):
                    await self.within(conn, "wake-up gate", conn.execute(self._wake_unlock))
            with contextlib.suppress(Exception):
                await conn.close()
            if moving and not await self._take_gate_on_listen():
                self._parked = False  # (the loop takes the gate on a claim connection)
        finally:
            self._gate_moving = False
        if self._parked:
            self._log.debug(
                "claim connection closed: nothing to claim for %gs; the LISTEN session waits",
                self._claim_idle.seconds,
            )
        self._wake()

    async def _take_gate_on_listen(self) -> bool:
        async def take(listen: psycopg.AsyncConnection[Any]) -> bool:
            row = await _fetchone(listen, self._try_wake_lock)
            if row is not None and row[0]:
                self._gate_conn = listen
                return True
            return False

        try:
            return bool(await self._on_listen("wake-up gate", take))
        except StoreError:
            return False

    # -- connections ----------------------------------------------------------------------------

    #: Plan the claim and settle statements once per connection (a generic plan), not at
    #: every execution: PostgreSQL kept re-planning the task claim with its parameters
    #: (custom plans, about 0.5 ms a claim, more than running it). Only where the session
    #: keeps state: behind a transaction pooler the SET would reach other clients.
    generic_plans = False
    #: With generic plans, also ``enable_seqscan = off`` for the session. The generic plan
    #: is made once for the connection's life, usually while the table is nearly empty (a
    #: relay started on a caught-up outbox, or after a TRUNCATE): PostgreSQL then chose
    #: sequential scans for the claim's UPDATEs by id and kept them while dead rows piled up,
    #: every claim reading the whole heap twice (bench/relay_steady.py: the relay's database
    #: CPU per event at 500 events/s). Discouraged, not forbidden: a statement with no
    #: usable index still runs.
    index_plans = False

    def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Set up a new claim or settle connection (loaders): JSON by orjson."""
        set_json_loads(orjson.loads, conn)

    async def _connection(self, role: Role) -> psycopg.AsyncConnection[Any]:
        if role == "settle":
            self._settle_idle.used()
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
                await conn.execute(
                    "SET plan_cache_mode = force_generic_plan"
                    + ("; SET enable_seqscan = off" if self.index_plans else "")
                )
            except BaseException:
                await conn.close()
                raise
        if role == "claim":
            self._claim_conn = conn
            self._claim_idle.used()
        else:
            self._settle_conn = conn
        return conn

    def _close_idle_settle(self) -> float | None:
        """Close the settle connection once nothing used it for :data:`SETTLE_IDLE`."""
        conn = self._settle_conn
        if conn is None or conn.closed:
            return None
        if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            return 0.1
        self._settle_conn = None
        closing = asyncio.ensure_future(conn.close())
        self._closing.add(closing)  # (a task only weakly held by the loop)
        closing.add_done_callback(self._closing.discard)
        return None

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
        self._settle_idle.cancel()
        self._claim_idle.cancel()
        if self._due_timer is not None:
            self._due_timer.cancel()
            self._due_timer = None
        self._parked = False
        for conn in (self._claim_conn, self._settle_conn, self._direct_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._claim_conn = self._settle_conn = self._gate_conn = self._direct_conn = None


async def _pump(conn: psycopg.AsyncConnection[Any], wake: _Woken, seconds: float) -> None:
    async for notify in conn.notifies(timeout=seconds):
        wake(notify.payload)


def _nothing() -> None:
    pass


def _settle(done: asyncio.Future[Any], exc: BaseException) -> None:
    """``done`` fails with ``exc``, unless its caller gave up already (cancelled: a stop)."""
    if not done.done():
        done.set_exception(exc)


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


async def _fetchone(conn: psycopg.AsyncConnection[Any], statement: str, params: Any = None) -> Any:
    cur = await conn.execute(statement, params)
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
