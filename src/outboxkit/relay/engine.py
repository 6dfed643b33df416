"""The relay: ``Relay(...)`` checks its options once and runs the source they name.

``source="poll"`` claims the outbox table's rows (relay/polling.py: claim → publish →
settle, pipelined, fenced); ``source="cdc"`` streams its replication slot (relay/wal.py).
Both share the Relay's stats, observers and outage log.
"""

from __future__ import annotations

from typing import Literal, Protocol

from outboxkit._redact import remember_secrets
from outboxkit.backends import backend_for
from outboxkit.backends.ports import PoolerMode, pooler_mode
from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import Publisher, batch_shape
from outboxkit.queue.loop import default_owner_id
from outboxkit.relay.ordered import DeadLetterPolicy
from outboxkit.relay.polling import PollingSource
from outboxkit.relay.status import RelayStatus
from outboxkit.relay.wal import WalSource
from outboxkit.sink.observer import (
    Observers,
    RelayObserver,
    RelayStats,
    StatsObserver,
    default_observer,
)
from outboxkit.sink.outage import OutageLog

Retention = Literal["delete", "keep"]
#: Where the relay reads events: the table (claims) or the replication slot (outboxkit.cdc).
Source = Literal["poll", "cdc"]

__all__ = ["Relay"]


class RelaySource(Protocol):
    """What a Relay runs: the claim loop (``poll``, relay/polling.py) or the replication
    stream (``cdc``, relay/wal.py). Each builds only what it uses."""

    def stop(self) -> None: ...

    @property
    def stopping(self) -> bool: ...

    async def run(self) -> None: ...

    def status(self) -> RelayStatus: ...


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
        # The database's backend, chosen once: its queue store, what it cannot do (the WAL
        # source, a transaction pooler's settings: MariaDB/MySQL is polled, said in one line).
        self.backend = backend_for(dsn)
        if source != "poll" or pooler or direct_dsn:
            self.backend.refuse("pooler")
        # A bad ?pooler= or a DSN libpq cannot parse fails here, not at the first connection.
        self.backend.check_dsn(dsn)
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
        self.relay_id = relay_id or default_owner_id()
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
        if source not in ("poll", "cdc"):
            raise ConfigurationError(f"source must be 'poll' or 'cdc', not {source!r}")
        self.source: Source = source
        # source="cdc": run() and stop() drive the WAL relay, which shares the stats,
        # observers and outage log (metrics, /readyz and the summary log see it alike).
        self._source: RelaySource = (
            WalSource(self, slot)
            if source == "cdc"
            else PollingSource(
                self,
                dead_letter_policy=dead_letter_policy,
                unique_id=relay_id is None,
            )
        )
        #: The WAL relay a ``source="cdc"`` relay runs (None when it polls).
        self.cdc = self._source.cdc if isinstance(self._source, WalSource) else None

    def __repr__(self) -> str:
        return f"Relay(table={self.table!r}, relay_id={self.relay_id!r})"

    # -- lifecycle ----------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming, finish in-flight batches, release what was not published."""
        self._source.stop()

    @property
    def stopping(self) -> bool:
        return self._source.stopping

    async def run(self) -> None:
        """Relay until :meth:`stop` is called. Raises only for errors a restart won't fix.

        Whatever ends it (stop, an error at start, a side task that died), the
        connections and the publisher are closed before it returns or raises, and a
        relay whose start failed can be run again.
        """
        await self._source.run()

    @property
    def partitions_owned(self) -> int | None:
        """Ordered mode: the partitions this relay holds now (None when not ordered)."""
        source = self._source
        return source.partitions_owned if isinstance(source, PollingSource) else None

    def status(self) -> RelayStatus:
        """The relay's state for readiness and metrics (no I/O)."""
        return self._source.status()
