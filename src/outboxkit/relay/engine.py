"""The relay engine: claim → publish → settle, pipelined, fenced, and hard to kill.

No database transaction or row lock is held while a broker is talked to: the
claim is one short statement that leases rows, the publish happens with no
transaction open, the settle is one short statement per outcome fenced by the
claim's token. A relay that dies leaves leases that simply expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.types.json import set_json_loads

from outboxkit._backoff import Backoff, bounded_retry_after, full_jitter
from outboxkit._redact import redact, remember_secrets
from outboxkit._text import first_line
from outboxkit.errors import (
    ConfigurationError,
    SchemaError,
    relay_schema_outdated,
    table_missing,
)
from outboxkit.publishers.base import (
    OutboundMessage,
    Publisher,
    PublishResult,
    batch_shape,
    unreachable,
)
from outboxkit.relay.heartbeat import LeaseHeartbeat
from outboxkit.relay.maintenance import partition_maintenance
from outboxkit.relay.observer import (
    Observers,
    RelayObserver,
    RelayStats,
    StatsObserver,
    default_observer,
)
from outboxkit.relay.ordered import DeadLetterPolicy, OrderedMode
from outboxkit.relay.outage import FailureEpisode, OutageLog
from outboxkit.store.postgres import Statements, Status

if TYPE_CHECKING:
    from outboxkit.cdc.relay import CdcRelay

log = logging.getLogger("outboxkit.relay")

Retention = Literal["delete", "keep"]
#: Where the relay reads events: the table (claims) or the replication slot (outboxkit.cdc).
Source = Literal["poll", "cdc"]
_MAX_ERROR_CHARS = 2000
_MAX_RETRY_DELAY = 30 * 86400.0  # the longest wait a settle schedules (seconds)
# The start-up count of pending events stops here: it reads the pending index only.
_PENDING_CAP = 100_000


def _bounded(retry_after: float | None) -> float:
    """A publisher's ``retry_after`` as a delay the settle can store (added to ``now()``)."""
    return bounded_retry_after(retry_after, _MAX_RETRY_DELAY)


def default_relay_id() -> str:
    """host-pid-random: unique per process, readable in `claimed_by`."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class _Batch:
    """One claim: the rows' ids and their messages, in outbox order, and the fencing token."""

    __slots__ = ("claimed_at", "ids", "messages", "token")

    def __init__(self, token: uuid.UUID, ids: list[int], messages: list[OutboundMessage]) -> None:
        self.token = token
        self.ids = ids
        self.messages = messages
        self.claimed_at = time.monotonic()


_ROW_ID = operator.itemgetter(0)
# While a writer holds the wake-up gate open (between its INSERT and its COMMIT), a relay
# with nothing to do looks again after this long, doubling up to the second figure.
_GATE_RETRY = (0.005, 0.1)


# A relay that found work looks again after this long (then twice as long, ...): at a
# steady 1 000 events/s, 1 ms gave 1.9 events per claim and 2 ms 3.0, for a third less
# relay CPU per event at +0.5 ms p50 (bench/concurrent_writers.py --latency-only).
_FIRST_LOOK = 0.002


def _linger_waits(linger: float, first: float = _FIRST_LOOK) -> tuple[float, ...]:
    """``first``, then doubling (2, 4, 8, ... ms) until they add up to ``linger``."""
    waits: list[float] = []
    wait, total = first, 0.0
    while total < linger - 1e-9:
        step = min(wait, linger - total)
        waits.append(step)
        total += step
        wait *= 2
    return tuple(waits)


class Relay:
    """Moves events from an outbox table to a broker with at-least-once delivery.

    Run it with ``await relay.run()`` (returns after :meth:`stop`), or use
    ``outboxkit relay`` which adds signal handling. Several relays may share one
    table: ``FOR UPDATE SKIP LOCKED`` and leases keep their claims apart.

    ``batch_size`` and ``max_in_flight`` default to the publisher's ``batch_shape``
    (``outboxkit relay --help`` lists each broker's). The relay's own
    claims and settles commit without waiting for the WAL flush unless
    ``synchronous_commit=True``: a database crash can then cause re-publication,
    never loss (docs/architecture.md).

    Wake-up: a relay that found work looks again after 2, 4, 8, ... ms for ``linger``
    seconds (default 0.03, at most ``poll_interval``) before it waits for a ``NOTIFY``;
    only a waiting relay makes writers notify (the wake-up gate, store/postgres.py
    ``WAKE_GATE``), so writers committing while events flow skip NOTIFY's commit-time
    lock. ``linger=0`` waits at once after every batch that was not full.

    ``lease`` is how long a claim holds its rows without news from this relay: a
    publish still running after ``lease / 3`` extends its rows' lease every
    ``lease / 3`` (a fenced UPDATE), so a slow broker or webhook is not cut at the
    lease. ``publish_timeout`` (default ``0.8 * lease``) is the hard bound of one
    publish and may exceed the lease. A relay that dies stops extending: its rows
    are claimable again within one lease.

    ``source="cdc"`` reads the events from the outbox's logical replication slot
    (``slot``, default ``outboxkit_<table>``) instead of claiming rows: ``run()`` and
    ``stop()`` then drive an ``outboxkit.cdc.relay.CdcRelay`` (``relay.cdc``) with these
    options, stats and observers; the claim options do not apply to it.
    """

    def __init__(
        self,
        dsn: str,
        publisher: Publisher,
        *,
        table: str = "outbox",
        batch_size: int | None = None,
        poll_interval: float = 1.0,
        lease: float = 30.0,
        max_attempts: int = 10,
        retention: Retention = "delete",
        relay_id: str | None = None,
        retry_base: float = 1.0,
        retry_cap: float = 300.0,
        max_in_flight: int | None = None,
        listen: bool = True,
        linger: float = 0.03,
        shutdown_timeout: float = 10.0,
        publish_timeout: float | None = None,
        observer: RelayObserver | None = None,
        synchronous_commit: bool = False,
        source: Source = "poll",
        slot: str | None = None,
        ordered: bool = False,
        dead_letter_policy: DeadLetterPolicy = "block",
    ) -> None:
        # Unset: the shape the publisher suits best (publishers.base.batch_shape).
        shape = batch_shape(publisher)
        max_in_flight = shape[1] if max_in_flight is None else max_in_flight
        if batch_size is None and ordered:
            # Consecutive batches in id order share keys, and a key's next batch waits for
            # the one in flight: the pipeline's rows split into max_in_flight batches keep
            # flowing (measured: docs/benchmarks.md, ordered relay).
            batch_size = max(1, shape[0] // max_in_flight)
        batch_size = shape[0] if batch_size is None else batch_size
        if batch_size < 1:
            raise ConfigurationError("batch_size must be at least 1")
        if lease <= 0 or poll_interval <= 0:
            raise ConfigurationError("lease and poll_interval must be positive")
        if linger < 0:
            raise ConfigurationError("linger must not be negative")
        linger = min(linger, poll_interval)  # a faster poll needs no lingering beyond it
        if max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        if retention not in ("delete", "keep"):
            raise ConfigurationError(f"retention must be 'delete' or 'keep', not {retention!r}")
        if max_in_flight < 1:
            raise ConfigurationError("max_in_flight must be at least 1")
        self.dsn = dsn
        remember_secrets(dsn)  # masked in any log line or stored error that quotes it
        self.publisher = publisher
        self.table = table
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.lease = lease
        self.max_attempts = max_attempts
        self.retention: Retention = retention
        self.relay_id = relay_id or default_relay_id()
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.max_in_flight = max_in_flight
        self.listen = listen
        self.shutdown_timeout = shutdown_timeout
        # The hard bound of one publish. It may exceed the lease: a publish still running
        # extends its rows' lease every lease/3 (relay/heartbeat.py).
        if publish_timeout is not None and not publish_timeout > 0:
            raise ConfigurationError("publish_timeout must be positive")
        self.publish_timeout = publish_timeout if publish_timeout is not None else lease * 0.8
        # The relay's own writes (claims, settles) commit without waiting for a WAL
        # flush unless asked: a database crash can then only cause re-publication,
        # never loss (see store/postgres.py), and each batch saves two fsync waits.
        self.synchronous_commit = synchronous_commit
        self._commit: str | None = None if synchronous_commit else "off"
        # Counters, metrics, tracing and summary logs hook in here (relay/observer.py): every
        # fact of the relay reaches them through the same hooks, the stats included.
        # A hook that raises is logged, never allowed to break a batch (Observers guards it).
        self.stats = RelayStats()
        self.observer: RelayObserver = Observers(
            StatsObserver(self.stats), default_observer() if observer is None else observer
        )
        # Publish failures are logged as outages, a few lines per relay (relay/outage.py).
        self.outage = OutageLog(max_attempts=max_attempts)
        self._db_outage = FailureEpisode("database")
        self._sql = Statements(table)
        # Ordered mode (relay/ordered.py): per-key order through partition leases; it
        # swaps in its claim, its fenced settles and a partition heartbeat side task.
        self.ordered = ordered
        self._ordered = OrderedMode(self, dead_letter_policy) if ordered else None
        if self._ordered is not None:
            self._sql = self._ordered.sql
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        # The wake-up gate: after work, look again at these intervals (2, 4, 8, ... ms,
        # `linger` in all), then hold the gate's lock (writers notify) and wait.
        self.linger = linger
        self._linger_waits = _linger_waits(linger)
        self._linger_step = len(self._linger_waits)
        self._gate_conn: psycopg.AsyncConnection[Any] | None = None
        self._cursors: dict[str, psycopg.AsyncCursor[Any]] = {}
        self._gate_retry = _GATE_RETRY[0]
        self._slots = asyncio.Semaphore(max_in_flight)
        self._in_flight: set[asyncio.Task[None]] = set()
        self._claim_conn: psycopg.AsyncConnection[Any] | None = None
        self._settle_conn: psycopg.AsyncConnection[Any] | None = None
        self._settle_lock = asyncio.Lock()
        self._db_backoff = Backoff(base=0.2, cap=10.0)
        # Paces rows handed back untried while the broker is unreachable: attempts are
        # not counted then (an outage must not dead-letter healthy events), so the
        # rows' own backoff does not grow; this one does, per relay, until a publish works.
        self._broker_backoff = Backoff(base=retry_base, cap=retry_cap)
        self._running = False
        # The first unexpected error of a side task or a batch task: it stops the relay.
        self._failure: BaseException | None = None
        # source="cdc": run() and stop() delegate to the WAL relay, which shares the stats,
        # observers and outage log (metrics, /readyz and the summary log see it alike).
        if source not in ("poll", "cdc"):
            raise ConfigurationError(f"source must be 'poll' or 'cdc', not {source!r}")
        self.source: Source = source
        self.cdc = _cdc_relay(self, slot) if source == "cdc" else None

    def __repr__(self) -> str:
        return f"Relay(table={self.table!r}, relay_id={self.relay_id!r})"

    # -- lifecycle ----------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming, finish in-flight batches, release what was not published."""
        self._stopping.set()
        if self.cdc is not None:
            self.cdc.stop()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self) -> None:
        """Relay until :meth:`stop` is called. Raises only for errors a restart won't fix.

        Whatever ends it (stop, an error at start, a side task that died), the
        connections and the publisher are closed before it returns or raises, and a
        relay whose start failed can be run again.
        """
        if self.cdc is not None:
            await self.cdc.run()
            return
        if self._running:
            raise RuntimeError("this Relay is already running")
        self._running = True
        self._failure = None
        publisher_started = False
        try:
            log.info(
                "relay %s starting: table=%s publisher=%s batch_size=%d max_in_flight=%d"
                " lease=%.1fs synchronous_commit=%s",
                self.relay_id,
                self.table,
                self.publisher.name,
                self.batch_size,
                self.max_in_flight,
                self.lease,
                "on" if self.synchronous_commit else "off",
            )
            # The table first: a missing table fails here, before any broker is contacted.
            await self._check_table()
            publisher_started = True  # a start that fails half-way may hold a connection
            await self.publisher.start()
            log.info("publisher %s started; claiming batches", self.publisher.name)
            await self._supervise()
        finally:
            await self._close_connections()
            if publisher_started:
                try:
                    await self.publisher.close()
                except Exception as exc:
                    log.warning(
                        "publisher %s did not close cleanly: %s",
                        self.publisher.name,
                        redact(f"{type(exc).__name__}: {exc}"),
                    )
            self._running = False
            log.info(
                "relay %s stopped: published=%d retried=%d dead_lettered=%d released=%d",
                self.relay_id,
                self.stats.published,
                self.stats.retried,
                self.stats.dead_lettered,
                self.stats.released,
            )

    async def _supervise(self) -> None:
        """Run the claim loop with its side tasks; the first failure of either stops both.

        A side task (the LISTEN connection) or a batch task that dies with an
        unexpected error stops the relay the way :meth:`stop` does (in-flight batches
        finish or are released), then that error is raised: a relay limping on without
        it would hide the failure (procrastinate's worker supervises its side tasks alike).
        """
        side_tasks = self._start_side_tasks()
        monitor = asyncio.create_task(
            self._monitor_side_tasks(side_tasks), name="outboxkit-relay:monitor"
        )
        try:
            await self._claim_loop()
        finally:
            monitor.cancel()
            await self._drain_in_flight()
            for task, exc in await _cancel_and_capture_errors([monitor, *side_tasks]):
                self._fail(task.get_name(), exc)  # (ignored if it stopped the relay already)
        if self._failure is not None:
            raise self._failure

    def _start_side_tasks(self) -> list[asyncio.Task[None]]:
        # A partitioned outbox: partitions ahead, expired ones dropped (relay/maintenance.py).
        maintenance = partition_maintenance(self.dsn, self.table, self._stopping)
        tasks = [asyncio.create_task(maintenance, name="outboxkit-relay:partitions")]
        if self._ordered is not None:  # ordered mode's partition leases (relay/partitions.py)
            leases = self._ordered.run()
            tasks.append(asyncio.create_task(leases, name="outboxkit-relay:partition-leases"))
        if not self.listen:
            return tasks
        return [*tasks, asyncio.create_task(self._listen(), name="outboxkit-relay:listen")]

    @property
    def partitions_owned(self) -> int | None:
        """Ordered mode: the partitions this relay holds now (None when not ordered)."""
        return None if self._ordered is None else self._ordered.owned_count()

    async def _monitor_side_tasks(self, side_tasks: list[asyncio.Task[None]]) -> None:
        """Wait for a side task to end; one that failed stops the relay with its error."""
        pending = set(side_tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and (exc := task.exception()) is not None:
                    self._fail(task.get_name(), exc)
                    return

    def _fail(self, what: str, exc: BaseException) -> None:
        """Stop the relay because ``what`` failed; :meth:`run` raises ``exc`` once closed."""
        if self._failure is None:
            self._failure = exc
            log.error(
                "%s failed, stopping the relay: %s",
                what,
                redact(f"{type(exc).__name__}: {exc}"),
                exc_info=exc,
            )
        self.stop()

    def _on_batch_done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._fail("batch", exc)

    async def _check_table(self) -> None:
        """Say what the relay found at start; raise if the table is missing.

        An unreachable database is not fatal here: the claim loop retries it.
        """
        try:
            conn = await self._connection("claim")
            cur = await conn.execute(self._sql.count_pending_capped, {"cap": _PENDING_CAP})
            row = await cur.fetchone()
            pending = int(row[0]) if row else 0
            await conn.execute(self._sql.check_columns)
            if self._ordered is not None:
                await self._ordered.check_schema()  # SchemaError: run migrate --ordered
        except pg_errors.UndefinedTable:
            database = self._claim_conn.info.dbname if self._claim_conn else None
            raise table_missing(self.table, database=database) from None
        except pg_errors.UndefinedColumn as exc:
            raise (relay_schema_outdated(exc, self.table) or exc) from None
        except psycopg.Error as exc:
            log.warning(
                "database not reachable at start (%s); retrying",
                first_line(exc),
            )
            return
        log.info(
            "connected to database %s on %s; table %s found with %s%d pending event(s)",
            conn.info.dbname,
            conn.info.host,
            self.table,
            "at least " if pending >= _PENDING_CAP else "",
            pending,
        )

    # -- the loop -----------------------------------------------------------------

    async def _claim_loop(self) -> None:
        while await self._acquire_slot():
            # Clear before claiming: a commit notified during the claim wakes the next one.
            self._wake.clear()
            try:
                batch = await self._claim()
            except psycopg.Error as exc:
                # A lost connection or a failed statement (a timeout, a trigger): back off, retry.
                self._slots.release()
                await self._on_db_error("claim", exc)
                continue
            except BaseException:
                self._slots.release()
                raise
            if batch is None:
                self._slots.release()
                await self._wait_for_work()
                continue
            task = asyncio.create_task(self._process(batch))
            if self._ordered is not None:
                self._ordered.track(task)
            self._in_flight.add(task)
            task.add_done_callback(self._on_batch_done)
            # Work found: look again soon, and writers need not notify meanwhile.
            self._linger_step = 0
            self._gate_retry = _GATE_RETRY[0]
            if self._gate_conn is not None:
                await self._open_gate()
            if len(batch.ids) < self.batch_size:
                # Caught up: look again after a few ms, then wait for a NOTIFY or the poll
                # interval. A full batch loops straight back and claims N+1 while N is
                # being published.
                await self._wait_for_work()

    async def _acquire_slot(self) -> bool:
        """Wait for an in-flight slot; False once stopping (even while slots are busy)."""
        if self._stopping.is_set():
            return False
        if not self._slots.locked():
            # A free slot is taken without yielding to the event loop, so the next claim
            # is sent to the database before the batch just claimed starts producing:
            # the claim's database time then overlaps the publisher's CPU time.
            await self._slots.acquire()
            return True
        acquire = asyncio.ensure_future(self._slots.acquire())
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({acquire, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not acquire.done():
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
        if acquire.done() and not acquire.cancelled():
            if not self._stopping.is_set():
                return True
            self._slots.release()
        return False

    async def _wait_for_work(self) -> None:
        if self._wake.is_set() or self._stopping.is_set():
            return
        step = self._linger_step
        if step < len(self._linger_waits):  # lingering after work: look again shortly
            self._linger_step = step + 1
            await self._wait(self._linger_waits[step])
            return
        if self._gate_conn is not None and self._gate_conn is not self._claim_conn:
            self._gate_conn = None  # its connection was replaced: the lock went with it
        if self.listen and self._gate_conn is None:
            if await self._close_gate():
                return  # claim once more: what writers committed without a NOTIFY is visible
            # A writer is between its INSERT and its COMMIT (or another relay waits):
            # look again soon, less often the longer it lasts.
            retry = self._gate_retry
            self._gate_retry = min(retry * 2, _GATE_RETRY[1])
            await self._wait(retry)
            return
        await self._wait(self.poll_interval)

    async def _wait(self, seconds: float) -> None:
        # asyncio.timeout, not wait_for: wait_for wraps the wait in a task of its own,
        # 4 % of the event loop's time when the relay looks again every few ms.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _close_gate(self) -> bool:
        """Take the wake-up gate's lock: from now on writers notify. False if held elsewhere."""
        try:
            conn = await self._connection("claim")
            cur = await conn.execute(self._sql.try_wake_lock)
            row = await cur.fetchone()
        except psycopg.Error as exc:  # the next claim meets and handles it
            log.debug("could not take the wake-up lock: %s", redact(first_line(exc)))
            return False
        if row is None or not row[0]:
            return False
        self._gate_conn = conn
        return True

    async def _open_gate(self) -> None:
        """Release the wake-up gate's lock: writers stop notifying while this relay works."""
        conn, self._gate_conn = self._gate_conn, None
        if conn is None or conn.closed or conn is not self._claim_conn:
            return
        try:
            await conn.execute(self._sql.wake_unlock)
        except psycopg.Error as exc:
            log.debug("could not release the wake-up lock: %s", redact(first_line(exc)))

    async def _claim(self) -> _Batch | None:
        conn = await self._connection("claim")
        token = uuid.uuid4()
        started = time.perf_counter()
        statement = self._sql.claim_batch
        params = {
            "lease": self.lease,
            "token": token,
            "relay_id": self.relay_id,
            "limit": self.batch_size,
            "max_attempts": self.max_attempts,  # the crash-loop guard
            "commit": self._commit,
        }
        if self._ordered is not None:
            statement, params = self._ordered.claim(params)
        try:
            cur = self._cursor(conn, "claim")
            await cur.execute(statement, params)
            records = await cur.fetchall()
        except pg_errors.UndefinedTable:
            raise SchemaError(
                f"outbox table {self.table!r} not found in database"
                f" {conn.info.dbname!r}: run `outboxkit migrate --dsn ... --table {self.table}`"
            ) from None
        self._db_backoff.reset()
        self._db_outage.succeeded()
        self.observer.claimed(len(records), time.perf_counter() - started)
        self.outage.claimed(len(records), 0.0)
        if not records:
            return None
        # The claim returns rows in primary-key order in practice, not by contract:
        # sorting an already sorted list costs one pass.
        records.sort(key=_ROW_ID)
        ids = [r[0] for r in records]
        # Positional construction: the claim returns OutboundMessage's fields in order.
        messages = [OutboundMessage(*r[1:]) for r in records]
        return _Batch(token, ids, messages)

    async def _process(self, batch: _Batch) -> None:
        try:
            messages = batch.messages
            with self.observer.publishing(messages):
                started = time.perf_counter()
                if self._ordered is None:
                    results = await self._publish(batch)
                else:  # in waves, per key
                    results = await self._ordered.publish(batch)
                self.observer.published(messages, results, time.perf_counter() - started)
                self.outage.published(messages, results, 0.0)
            await self._settle(batch, results)
        except psycopg.Error as exc:
            # Not a lost connection (those are retried): the statement itself failed.
            # Unsettled rows keep their lease and are published again after it expires.
            log.error("settle failed: %s", redact(f"{type(exc).__name__}: {exc}"))
            self.observer.database_error("settle", exc, False)
        except asyncio.CancelledError:
            # Forced shutdown mid-publish: hand the rows back now rather than at lease expiry.
            await asyncio.shield(self._release(batch))
            raise
        finally:
            self._slots.release()

    async def _publish(self, batch: _Batch) -> Sequence[PublishResult]:
        messages = batch.messages
        # A publish still running after lease/3 extends its rows' lease every lease/3
        # (relay/heartbeat.py): only publish_timeout bounds it, never the lease.
        heartbeat = LeaseHeartbeat(lambda: self._extend_leases(batch), self.lease / 3)
        heartbeat.start()
        try:
            results = await asyncio.wait_for(
                self.publisher.publish_batch(messages), timeout=self.publish_timeout
            )
        except TimeoutError:
            error = f"publish not confirmed within {self.publish_timeout:.1f}s"
            return [PublishResult.retry(error, "publish_timeout")] * len(messages)
        except (ConnectionError, OSError) as exc:  # TimeoutError was caught above
            # The broker was never reached: nothing about these messages was judged.
            error = redact(f"{type(exc).__name__}: {exc}")
            return [PublishResult.hand_back(error, type(exc).__name__)] * len(messages)
        except Exception as exc:
            error = redact(f"{type(exc).__name__}: {exc}")
            return [PublishResult.retry(error, type(exc).__name__)] * len(messages)
        finally:
            await heartbeat.stop()
        if len(results) != len(messages):
            error = f"publisher returned {len(results)} results for {len(messages)} messages"
            return [PublishResult.retry(error, "publisher_bug")] * len(messages)
        return results

    async def _extend_leases(self, batch: _Batch) -> None:
        """One heartbeat: push the batch's leases to now() + lease, fenced by its token.

        A failure is logged and the publish goes on: the settle copes with a lost lease.
        """
        try:
            conn = await self._connection("settle")
            async with self._settle_lock:
                cur = await conn.execute(
                    self._sql.extend_leases, (self.lease, batch.ids, batch.token, self._commit)
                )
        except psycopg.Error as exc:
            lost = _connection_lost(exc)
            self.observer.database_error("extend", exc, lost)
            if self._settle_conn is not None and self._settle_conn.broken:
                with contextlib.suppress(Exception):
                    await self._settle_conn.close()
            log.warning(
                "could not extend the lease of %d row(s) still publishing (%s)",
                len(batch.ids),
                first_line(exc),
            )
            return
        log.debug(
            "publish running for %.1fs: extended the lease of %d of %d row(s) by %.1fs",
            time.monotonic() - batch.claimed_at,
            cur.rowcount,
            len(batch.ids),
            self.lease,
        )

    async def _settle(self, batch: _Batch, results: Sequence[PublishResult]) -> None:
        ids, messages = batch.ids, batch.messages
        if all(r.ok for r in results):  # the common case: one pass, no per-row lists
            await self._settle_published(batch, ids, messages, whole_claim=True)
            return
        published: list[int] = []
        published_messages: list[OutboundMessage] = []
        fail_ids: list[int] = []
        fail_status: list[int] = []
        fail_delay: list[float] = []
        fail_error: list[str] = []
        fail_refund: list[int] = []
        handed_back: list[int] = []
        outage_delay = 0.0
        # A retryable failure while the publisher's client reports the broker unreachable
        # (librdkafka's all-brokers-down, a lost NATS connection) is the outage's, not the
        # message's: handed back like a publish that was never tried.
        broker_down = unreachable(self.publisher) is not None
        if any(r.ok for r in results):
            self._broker_backoff.reset()
        elif broker_down or any(not r.counts_attempt for r in results):
            outage_delay = self._broker_backoff.next_delay()
        dead: list[tuple[OutboundMessage, PublishResult]] = []
        retried: list[tuple[OutboundMessage, PublishResult]] = []
        dead_ids: list[int] = []
        retried_ids: list[int] = []
        for row_id, message, result in zip(ids, messages, results, strict=True):
            if result.ok:
                published.append(row_id)
                published_messages.append(message)
                continue
            error = redact(result.error or "unknown error")[:_MAX_ERROR_CHARS]
            fail_ids.append(row_id)
            fail_error.append(error)
            if not result.counts_attempt or (broker_down and result.retryable):
                # Never tried (the publisher's own client failed): back in line, attempt refunded.
                fail_status.append(Status.PENDING)
                fail_delay.append(max(_bounded(result.retry_after), outage_delay))
                fail_refund.append(1)
                handed_back.append(row_id)
                continue
            fail_refund.append(0)
            if not result.retryable or message.attempt >= self.max_attempts:
                fail_status.append(Status.FAILED)
                fail_delay.append(0.0)
                dead.append((message, result))
                dead_ids.append(row_id)
            else:
                fail_status.append(Status.PENDING)
                delay = full_jitter(message.attempt, base=self.retry_base, cap=self.retry_cap)
                fail_delay.append(max(delay, _bounded(result.retry_after)))
                retried.append((message, result))
                retried_ids.append(row_id)

        if published:
            await self._settle_published(batch, published, published_messages)
        if fail_ids:
            params = (
                fail_ids,
                fail_status,
                fail_delay,
                fail_error,
                fail_refund,
                batch.token,
                self._commit,
            )
            done = await self._settle_statement(batch, self._sql.settle_failures, params, fail_ids)
            if done is None:
                return
            if done is not fail_ids:  # the fence dropped rows: report only those settled
                self._check_fenced(batch, len(fail_ids) - len(done), len(fail_ids))
                kept = set(done)
                retried = [f for i, f in zip(retried_ids, retried, strict=True) if i in kept]
                dead = [f for i, f in zip(dead_ids, dead, strict=True) if i in kept]
                handed_back = [i for i in handed_back if i in kept]
            self.observer.settled((), retried, dead)
            if handed_back:  # the publisher logged why, once; not a line per event
                first = fail_error[fail_ids.index(handed_back[0])]
                self.observer.handed_back(len(handed_back), first)
                log.debug("handed back %d event(s) untried, attempts not counted", len(handed_back))
            # Every failure, one line each at DEBUG (ids are greppable); the outage is a WARNING.
            for message, res in retried if log.isEnabledFor(logging.DEBUG) else ():
                log.debug(
                    "publish failed, will retry: topic=%s event_id=%s attempt=%d"
                    " error_class=%s error=%s",
                    message.topic,
                    message.event_id,
                    message.attempt,
                    res.error_class,
                    redact(res.error or ""),
                    extra={
                        "topic": message.topic,
                        "event_id": str(message.event_id),
                        "attempt": message.attempt,
                        "error_class": res.error_class,
                    },
                )
            for message, res in dead:
                log.error(
                    "event dead-lettered after %d attempt(s): topic=%s event_id=%s"
                    " error_class=%s error=%s",
                    message.attempt,
                    message.topic,
                    message.event_id,
                    res.error_class,
                    redact(res.error or ""),
                    extra={
                        "topic": message.topic,
                        "event_id": str(message.event_id),
                        "attempt": message.attempt,
                        "error_class": res.error_class,
                    },
                )

    async def _settle_published(
        self,
        batch: _Batch,
        ids: list[int],
        messages: Sequence[OutboundMessage],
        whole_claim: bool = False,
    ) -> None:
        params: tuple[Any, ...]
        if whole_claim and self._ordered is None:  # ids sorted (_claim): by token and range
            stmt = (
                self._sql.settle_claim_delete
                if self.retention == "delete"
                else self._sql.settle_claim_keep
            )
            params = (ids[0], ids[-1], batch.token, self._commit)
        else:  # some rows failed, or ordered (its fenced settles take the ids)
            stmt = (
                self._sql.settle_published_delete
                if self.retention == "delete"
                else self._sql.settle_published_keep
            )
            params = (ids, batch.token, self._commit)
        done = await self._settle_statement(batch, stmt, params, ids)
        if done is None:
            return
        if done is not ids:  # the fence dropped rows: report only those settled
            self._check_fenced(batch, len(ids) - len(done), len(ids))
            kept = set(done)
            messages = [m for i, m in zip(ids, messages, strict=True) if i in kept]
        if not self.stats.published and messages:
            log.info(
                "first batch published: %d event(s) via %s in %.0f ms",
                len(messages),
                self.publisher.name,
                1000 * (time.monotonic() - batch.claimed_at),
            )
        self.observer.settled(messages, (), ())

    def _check_fenced(self, batch: _Batch, lost: int, expected: int) -> None:
        if lost > 0:
            self.observer.lost_leases(lost)
            log.warning(
                "lease_lost: %d of %d row(s) were re-claimed by another relay before this one"
                " settled them (claimed %.1fs ago, lease %.1fs); they are published at least once",
                lost,
                expected,
                time.monotonic() - batch.claimed_at,
                self.lease,
            )

    async def _settle_statement(
        self, batch: _Batch, stmt: str, params: Sequence[Any], ids: list[int]
    ) -> list[int] | None:
        """Run one fenced settle statement of ``ids``, retrying through database outages.

        Returns the ids it changed: ``ids`` itself when all of them (told by the row
        count), fewer when another relay re-claimed some; None if it gave up at shutdown.
        Retrying is safe: the statement is fenced by the claim token, so once
        another relay re-claims the rows it changes nothing.
        """
        while True:
            try:
                conn = await self._connection("settle")
                async with self._settle_lock:  # one settle at a time uses the cursor
                    cur = self._cursor(conn, "settle")
                    await cur.execute(stmt, params)
                    done = (
                        ids
                        if cur.rowcount == len(ids)
                        else [row[0] for row in await cur.fetchall()]  # (RETURNING id)
                    )
                self._db_backoff.reset()
                self._db_outage.succeeded()
                return done
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                if self._stopping.is_set() and (
                    time.monotonic() - batch.claimed_at > self.lease + self.shutdown_timeout
                ):
                    log.warning(
                        "giving up settling %d row(s) at shutdown: the database is unreachable;"
                        " their leases expire and they will be published again",
                        len(batch.ids),
                    )
                    return None
                await self._on_db_error("settle", exc)

    async def _release(self, batch: _Batch) -> None:
        ids = batch.ids
        try:
            conn = await self._connection("settle")
            cur = await conn.execute(self._sql.release_leases, (ids, batch.token, self._commit))
            self.observer.handed_back(cur.rowcount, None)
            log.info("released %d lease(s) at shutdown", cur.rowcount)
        except psycopg.Error as exc:
            self.observer.database_error("release", exc, _connection_lost(exc))
            log.warning(
                "could not release %d lease(s) (%s); they expire in %.0fs",
                len(ids),
                redact(str(exc)),
                self.lease,
            )

    async def _drain_in_flight(self) -> None:
        if not self._in_flight:
            return
        pending = set(self._in_flight)
        _done, still = await asyncio.wait(pending, timeout=self.shutdown_timeout)
        for task in still:
            task.cancel()
        if still:
            await asyncio.gather(*still, return_exceptions=True)

    # -- connections ----------------------------------------------------------------

    def _cursor(
        self, conn: psycopg.AsyncConnection[Any], role: Literal["claim", "settle"]
    ) -> psycopg.AsyncCursor[Any]:
        """The connection's cursor for claims (or settles), kept across statements.

        A cursor per statement rebuilt psycopg's adaptation state every time: with a
        few events per claim that was a tenth of the relay's CPU. Binary results:
        payloads arrive as raw bytes instead of hex text to decode.
        """
        cur = self._cursors.get(role)
        if cur is None or cur.connection is not conn:
            cur = self._cursors[role] = conn.cursor(binary=True)
        return cur

    async def _connection(self, role: Literal["claim", "settle"]) -> psycopg.AsyncConnection[Any]:
        conn = self._claim_conn if role == "claim" else self._settle_conn
        if conn is not None and not conn.closed:
            return conn
        conn = await psycopg.AsyncConnection.connect(
            self.dsn,
            autocommit=True,
            connect_timeout=10,
            application_name=f"outboxkit-relay:{role}"[:63],
        )
        set_json_loads(orjson.loads, conn)
        if role == "claim":
            self._claim_conn = conn
        else:
            self._settle_conn = conn
        return conn

    async def _on_db_error(self, what: str, exc: psycopg.Error) -> None:
        """Report ``exc``, drop broken connections, and back off before the retry."""
        lost = _connection_lost(exc)
        self.observer.database_error(what, exc, lost)
        for conn in (self._claim_conn, self._settle_conn):
            if conn is not None and conn.broken:
                with contextlib.suppress(Exception):
                    await conn.close()
        delay = self._db_backoff.next_delay()
        if lost:
            self._db_outage.failed(
                "database unavailable during %s (%s); reconnecting in %.2fs",
                what,
                first_line(exc),
                delay,
            )
        else:
            # The connection works; the statement failed (a timeout, a lock, a trigger).
            log.error(
                "%s failed: %s; retrying in %.2fs",
                what,
                redact(f"{type(exc).__name__}: {exc}"),
                delay,
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=delay)

    async def _close_connections(self) -> None:
        for conn in (self._claim_conn, self._settle_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._claim_conn = self._settle_conn = None

    async def _listen(self) -> None:
        """Wake the claim loop on NOTIFY. Polling still runs: notifications are not durable."""
        backoff = Backoff(base=0.5, cap=10.0)
        channel = sql.Identifier(self._sql.channel)
        while not self._stopping.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.dsn,
                    autocommit=True,
                    connect_timeout=10,
                    application_name="outboxkit-relay:listen",
                ) as conn:
                    await conn.execute(sql.SQL("LISTEN {}").format(channel))
                    backoff.reset()
                    self._wake.set()  # anything committed while we were not listening
                    async for _notify in conn.notifies():
                        self._wake.set()
            except psycopg.OperationalError as exc:
                delay = backoff.next_delay()
                log.debug("LISTEN connection lost (%s); retrying in %.2fs", redact(str(exc)), delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), timeout=delay)


def _cdc_relay(relay: Relay, slot: str | None) -> CdcRelay:
    """The WAL relay a ``Relay(source="cdc")`` runs (``outboxkit.cdc.relay``), same options."""
    from outboxkit.cdc.relay import CdcRelay

    return CdcRelay(
        relay.dsn,
        relay.publisher,
        table=relay.table,
        slot=slot,
        batch_size=relay.batch_size,
        max_attempts=relay.max_attempts,
        retry_base=relay.retry_base,
        retry_cap=relay.retry_cap,
        publish_timeout=relay.publish_timeout,
        relay_id=relay.relay_id,
        observer=relay.observer,
        stats=relay.stats,
        outage=relay.outage,
    )


def _connection_lost(exc: psycopg.Error) -> bool:
    """Whether ``exc`` means the connection is gone (or was never made), not a failed statement.

    psycopg raises OperationalError for both: a lost or refused connection has no SQLSTATE,
    or one of class 08 (connection), 53 (e.g. too many connections) or 57P (shutdown,
    terminated); a statement timeout (57014) or a lock timeout (55P03) leaves it usable.
    """
    if isinstance(exc, psycopg.InterfaceError):
        return True
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith(("08", "53", "57P"))


async def _cancel_and_capture_errors(
    tasks: list[asyncio.Task[None]],
) -> list[tuple[asyncio.Task[None], Exception]]:
    """Cancel ``tasks``, wait for them all, and return the errors they ended with."""
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return [
        (task, result)
        for task, result in zip(tasks, results, strict=True)
        if isinstance(result, Exception)
    ]
