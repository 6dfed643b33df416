"""The relay engine: claim → publish → settle, pipelined, fenced, and hard to kill.

No database transaction or row lock is held while a broker is talked to: the
claim is one short statement that leases rows, the publish happens with no
transaction open, the settle is one short statement per outcome fenced by the
claim's token. A relay that dies leaves leases that simply expire.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from outboxkit._redact import redact, remember_secrets
from outboxkit._text import first_line
from outboxkit.backends.mariadb.queue import MariaDBQueueStore
from outboxkit.backends.mariadb.sql import is_mysql_url
from outboxkit.backends.postgres._connection import PoolerMode, pooler_mode, split_pooler
from outboxkit.backends.postgres.queue_pg import PgQueueStore
from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import OutboundMessage, Publisher, PublishResult, batch_shape
from outboxkit.queue.decide import RetryPolicy
from outboxkit.queue.loop import ClaimLoop, LoopOptions, LoopStatus
from outboxkit.queue.store import QueueStore, StoreDenied, StoreError
from outboxkit.relay.maintenance import partition_maintenance
from outboxkit.relay.ordered import DeadLetterPolicy, OrderedMode
from outboxkit.sink.observer import (
    Observers,
    RelayObserver,
    RelayStats,
    StatsObserver,
    default_observer,
)
from outboxkit.sink.outage import OutageLog
from outboxkit.sink.publisher import FailureLog, PublisherSink

if TYPE_CHECKING:
    from outboxkit.cdc.relay import CdcRelay

log = logging.getLogger("outboxkit.relay")

Retention = Literal["delete", "keep"]
#: Where the relay reads events: the table (claims) or the replication slot (outboxkit.cdc).
Source = Literal["poll", "cdc"]

__all__ = ["Relay", "RelayStatus", "default_relay_id"]


def default_relay_id() -> str:
    """host-pid-random: unique per process, readable in `claimed_by`."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, slots=True)
class RelayStatus:
    """What readiness and metrics read of a relay, typed (ops/metrics.py), read without I/O.

    ``denied``: why the database refuses the relay's writes (claiming stopped), or None.
    ``partitions_owned``: ordered mode's partitions held now (None when not ordered).
    ``stream_down``: ``--source cdc``, seconds the replication stream has been failing
    and the last error's class (None while it streams or waits as a standby).
    ``cdc``: the WAL relay's position and state, or None for the polling relay.
    """

    denied: str | None = None
    partitions_owned: int | None = None
    stream_down: tuple[float, str] | None = None
    cdc: CdcStatus | None = None


@dataclass(frozen=True, slots=True)
class CdcStatus:
    """The WAL relay's state for metrics: its stream, its slot and its confirmed position."""

    slot: str
    streaming: bool
    standby: bool
    confirmed_lsn: int
    lag_seconds: float


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
    only a waiting relay makes writers notify (the wake-up gate, backends/postgres/postgres.py
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

    Behind a transaction pooler (PgBouncer's ``pool_mode = transaction``; found by itself,
    or said by ``pooler`` / ``?pooler=`` in the DSN) the relay prepares no statements where
    the pooler keeps none, and what needs a session (LISTEN, the wake-up gate's lock,
    ordered mode's relay-id lock) uses ``direct_dsn``, a DSN of PostgreSQL itself; without
    one the relay polls (README, "Behind PgBouncer").
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
        pooler: PoolerMode | None = None,
        direct_dsn: str | None = None,
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
        self.pooler = None if pooler is None else pooler_mode(pooler)
        # MariaDB/MySQL (mysql:// or mariadb://): its queue store, polled (no NOTIFY there).
        self._mariadb = is_mysql_url(dsn)
        if self._mariadb and (source != "poll" or pooler or direct_dsn):
            raise ConfigurationError(
                "on MariaDB/MySQL the relay polls the outbox table only: the WAL source,"
                " pooler= and direct_dsn= need PostgreSQL"
            )
        # A bad ?pooler= or a DSN libpq cannot parse fails here, not at the first connection.
        if not self._mariadb:
            _check_dsn(split_pooler(dsn)[0])
        self.direct_dsn = direct_dsn
        if direct_dsn is not None:
            remember_secrets(direct_dsn)
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
        # extends its rows' lease every lease/3 (queue/heartbeat.py).
        if publish_timeout is not None and not publish_timeout > 0:
            raise ConfigurationError("publish_timeout must be positive")
        self.publish_timeout = publish_timeout if publish_timeout is not None else lease * 0.8
        # The relay's own writes (claims, settles) commit without waiting for a WAL
        # flush unless asked: a database crash can then only cause re-publication,
        # never loss (see backends/postgres/postgres.py), and each batch saves two fsync waits.
        self.synchronous_commit = synchronous_commit
        # Counters, metrics, tracing and summary logs hook in here (sink/observer.py): every
        # fact of the relay reaches them through the same hooks, the stats included.
        # A hook that raises is logged, never allowed to break a batch (Observers guards it).
        self.stats = RelayStats()
        self.observer: RelayObserver = Observers(
            StatsObserver(self.stats), default_observer() if observer is None else observer
        )
        # Publish failures are logged as outages, a few lines per relay (sink/outage.py).
        self.outage = OutageLog(max_attempts=max_attempts)
        self.ordered = ordered
        self.linger = linger
        # source="cdc": run() and stop() delegate to the WAL relay, which shares the stats,
        # observers and outage log (metrics, /readyz and the summary log see it alike).
        if source not in ("poll", "cdc"):
            raise ConfigurationError(f"source must be 'poll' or 'cdc', not {source!r}")
        self.source: Source = source
        # The relay is the queue core (outboxkit.queue.loop) with the publisher as its sink
        # and the outbox table as its store (backends/postgres/queue_pg.py). Ordered mode (per-key
        # order through partition leases, relay/ordered.py) is a claim policy and a sink
        # that publishes in waves, with the partition heartbeat as a side task.
        self._store: QueueStore[OutboundMessage] = (
            MariaDBQueueStore(dsn, table, OutboundMessage, retention=retention, ordered=ordered)
            if self._mariadb
            else PgQueueStore(
                dsn,
                table,
                OutboundMessage,
                retention=retention,
                ordered=ordered,
                synchronous_commit=synchronous_commit,
                pooler=self.pooler,
                direct_dsn=direct_dsn,
            )
        )
        self._sink = PublisherSink(publisher, self.publish_timeout)
        self._ordered = (
            OrderedMode(
                dsn,
                table,
                self._sink,
                relay_id=self.relay_id,
                lease=lease,
                dead_letter_policy=dead_letter_policy,
                pooler=self.pooler,
                direct_dsn=direct_dsn,
                unique_id=relay_id is None,
            )
            if ordered
            else None
        )
        options = LoopOptions(
            owner=self.relay_id,
            batch_size=batch_size,
            max_in_flight=max_in_flight,
            lease=lease,
            poll_interval=poll_interval,
            linger=linger,
            listen=listen,
            shutdown_timeout=shutdown_timeout,
            retry=RetryPolicy(max_attempts=max_attempts, base=retry_base, cap=retry_cap),
        )
        self._loop: ClaimLoop[OutboundMessage, PublishResult] = ClaimLoop(
            self._store,
            self._sink if self._ordered is None else self._ordered,
            Observers(self.observer, self.outage, FailureLog()),
            options,
            ordering=self._ordered,
            side_tasks=self._side_tasks(),
            logger=log,
        )
        self._loop.first_settled = self._first_batch
        self._running = False
        self.cdc = _cdc_relay(self, slot) if source == "cdc" else None

    def __repr__(self) -> str:
        return f"Relay(table={self.table!r}, relay_id={self.relay_id!r})"

    # -- lifecycle ----------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming, finish in-flight batches, release what was not published."""
        self._loop.stop()
        if self.cdc is not None:
            self.cdc.stop()

    @property
    def stopping(self) -> bool:
        return self._loop.stopping.is_set()

    async def run(self) -> None:
        """Relay until :meth:`stop` is called. Raises only for errors a restart won't fix.

        Whatever ends it (stop, an error at start, a side task that died), the
        connections and the publisher are closed before it returns or raises, and a
        relay whose start failed can be run again.
        """
        if self.cdc is not None:
            await self._check_database()
            await self.cdc.run()
            return
        if self._running:
            raise RuntimeError("this Relay is already running")
        self._running = True
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
            await self._loop.run()
        finally:
            await self._store.close()
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

    def _side_tasks(self) -> list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]]:
        # A partitioned outbox: partitions ahead, expired ones dropped (relay/maintenance.py).
        tasks: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = [
            (
                "outboxkit-relay:partitions",
                # (its advisory lock is a session's: PostgreSQL itself when given)
                lambda: partition_maintenance(
                    self.direct_dsn or self.dsn, self.table, self._loop.stopping
                ),
            )
        ]
        if self._mariadb:  # (partitioned tables are PostgreSQL's)
            tasks.clear()
        if self._ordered is not None:  # ordered mode's partition leases (relay/partitions.py)
            tasks.append(("outboxkit-relay:partition-leases", self._ordered.run))
        return tasks

    @property
    def partitions_owned(self) -> int | None:
        """Ordered mode: the partitions this relay holds now (None when not ordered)."""
        return None if self._ordered is None else self._ordered.owned_count()

    def status(self) -> RelayStatus:
        """The relay's state for readiness and metrics (no I/O)."""
        cdc = self.cdc
        if cdc is not None:
            return RelayStatus(
                stream_down=cdc.stream_down(),
                cdc=CdcStatus(
                    cdc.slot, cdc.streaming, cdc.standby, cdc.confirmed_lsn, cdc.lag_seconds()
                ),
            )
        loop: LoopStatus = self._loop.status()
        return RelayStatus(denied=loop.denied, partitions_owned=self.partitions_owned)

    def _first_batch(self, count: int, seconds: float) -> None:
        log.info(
            "first batch published: %d event(s) via %s in %.0f ms",
            count,
            self.publisher.name,
            1000 * seconds,
        )

    async def _check_database(self) -> None:
        """The WAL relay's start: a database that refuses us for good stops it in one line.

        An unreachable server is left to the stream's own reconnects.
        """
        import psycopg

        from outboxkit.backends.postgres._connection import aconnect

        try:
            conn = await aconnect(self.dsn, application_name=f"{self.relay_id}:check"[:63])
        except psycopg.OperationalError as exc:
            if (fault := _configuration_fault(exc)) is not None:
                raise ConfigurationError(
                    f"the database refused the relay: {first_line(exc)} — {fault}"
                ) from None
            return
        await conn.close()

    async def _check_table(self) -> None:
        """Say what the relay found at start; raise if the table is missing.

        An unreachable database is not fatal here: the claim loop retries it. A role that
        cannot settle (no UPDATE or DELETE, a read-only server) is refused: the loop
        claims nothing until it can (issue 26, item 5).
        """
        try:
            info = await self._store.start()
            if self._ordered is not None:
                await self._ordered.check_schema()  # SchemaError: run migrate --ordered
        except StoreDenied as exc:
            self._loop.deny(exc, "settles")
            return
        except StoreError as exc:
            if (fault := _configuration_fault(exc.cause)) is not None:
                raise ConfigurationError(
                    f"the database refused the relay: {first_line(exc.cause)} — {fault}"
                ) from None
            log.warning("database not reachable at start (%s); retrying", first_line(exc.cause))
            return
        log.info(
            "connected to %s; table %s found with %s%d pending event(s)",
            info.where,
            self.table,
            "at least " if info.pending_capped else "",
            info.pending,
        )


# What a restart does not fix: an unknown database (SQLSTATE 3D000), an unknown role or a
# refused host (28000), a wrong password (28P01). libpq reports them at connect without a
# SQLSTATE, so its FATAL message is read too. Anything else at start (a refused port, a
# timeout) is an outage and retried.
_CONFIGURATION_FAULTS = {
    "3D000": "check the database name in --dsn (or create it)",
    "28000": "check the user name in --dsn and pg_hba.conf",
    "28P01": "check the password in --dsn",
}
_FATAL_MESSAGES = (
    (re.compile(r'database "[^"]*" does not exist'), "3D000"),
    (re.compile(r'role "[^"]*" does not exist|no pg_hba\.conf entry'), "28000"),
    (re.compile(r"password authentication failed"), "28P01"),
)


def _check_dsn(dsn: str) -> None:
    """Refuse a DSN libpq cannot parse, at construction and in one line.

    It failed later as a traceback from a side task, with psycopg's reason quoting the
    password ("invalid percent-encoded token: \"S3cret%ZZ\""): quoted words are masked.
    """
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    try:
        conninfo_to_dict(dsn)
    except ProgrammingError as exc:
        reason = re.sub(r'"[^"]*"', '"***"', (str(exc).splitlines() or [""])[0])
        raise ConfigurationError(
            f"the relay's dsn is not a valid PostgreSQL connection string: {reason}; write"
            " a postgresql:// URL (percent-encode the user name and password: % as %25,"
            " @ as %40) or libpq key=value pairs"
        ) from None


def _configuration_fault(exc: BaseException) -> str | None:
    """What to fix when ``exc`` is a configuration error no retry cures, or None."""
    state = getattr(exc, "sqlstate", None)
    if state is None:
        text = str(exc)
        state = next((code for pattern, code in _FATAL_MESSAGES if pattern.search(text)), None)
    return _CONFIGURATION_FAULTS.get(state) if state else None


def _cdc_relay(relay: Relay, slot: str | None) -> CdcRelay:
    """The WAL relay a ``Relay(source="cdc")`` runs (``outboxkit.cdc.relay``), same options.

    Imported when used: ``import outboxkit`` does not load the WAL relay's modules.
    """
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
        pooler=relay.pooler,
        observer=relay.observer,
        stats=relay.stats,
        outage=relay.outage,
    )
