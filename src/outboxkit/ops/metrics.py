"""Prometheus metrics of a relay: counters and histograms from its hooks, gauges from the table.

Labels are the topic and the error class only, never an event id or key, and
topics are labelled only for the busiest ``max_topics`` (or an allow-list), the
rest summed as ``(other)``: the number of series stays flat however many events,
keys or topics flow (100 000 distinct topics once made a 181 MB scrape). The table gauges
(backlog, in flight, failed, oldest pending age) are read by one background
task every ``gauge_interval`` seconds with two bounded queries on the partial
indexes, not at scrape time, through the backend's gauge reader (``Backend.gauge_reader``:
``METRICS_*`` in backends/postgres/postgres.py, MariaDB's in backends/mariadb/admin_sql.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from outboxkit._redact import redact
from outboxkit._text import first_line
from outboxkit.backends import backend_for
from outboxkit.backends.ports import GaugeReader
from outboxkit.publishers.base import (
    OutboundMessage,
    PublishResult,
    restored_since,
    unreachable,
)
from outboxkit.relay.status import CdcStatus, RelayStatus
from outboxkit.sink.observer import Failure, RelayObserver

log = logging.getLogger("outboxkit.metrics")

#: Created-to-confirmed latency: from milliseconds (caught up) to an hour (outage backlog).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
#: Broker round trip of one batch.
RTT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CLAIM_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
BATCH_SIZE_BUCKETS = (0, 1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
#: Rows each gauge query reads at most; beyond it the counts saturate (see `gauges_truncated`).
DEFAULT_GAUGE_ROW_CAP = 100_000
#: Longest error class kept as a label value (classes are type names, this only guards typos).
_MAX_CLASS_CHARS = 64
#: Seconds a publisher must report its broker unreachable before /readyz says so
#: (a reconnect that takes milliseconds is not an outage).
UNREACHABLE_AFTER = 1.0
#: Distinct error classes labelled; further ones are counted as ``other``.
_MAX_CLASSES = 32
#: Topics with a series of their own by default; the others are summed as :data:`OTHER_TOPICS`.
DEFAULT_MAX_TOPICS = 100
#: The label value of every topic outside the labelled set (parentheses: no broker's usual name).
OTHER_TOPICS = "(other)"


class TopicLabels:
    """Chooses which topics get series of their own: the busiest ``limit``, or an allow-list.

    Volume is the events settled per topic (published, retried or dead-lettered),
    halved at every re-rank so it follows today's traffic. Between re-ranks a new
    topic gets a label while there is room; at a re-rank a busier outsider takes
    the place of a quieter topic, and a topic idle for ``idle_after`` seconds
    leaves the set. The series of a topic that left are removed (its later events
    count under ``(other)``), so neither memory nor the scrape grows with topics.
    """

    def __init__(
        self,
        limit: int = DEFAULT_MAX_TOPICS,
        *,
        allow: Iterable[str] | None = None,
        rerank_every: float = 60.0,
        idle_after: float = 900.0,
    ) -> None:
        if limit < 0:
            raise ValueError("the number of labelled topics cannot be negative")
        self.limit = limit
        self.allow = frozenset(allow) if allow is not None else None
        self.rerank_every = rerank_every
        self.idle_after = idle_after
        self.labelled: set[str] = set()
        self._volume: dict[str, float] = {}
        self._last_seen: dict[str, float] = {}
        self._next_rerank = time.monotonic() + rerank_every

    def count(self, topic: str, n: int = 1) -> str:
        """Record ``n`` settled events of ``topic``; return its label value."""
        if self.allow is not None:
            return topic if topic in self.allow else OTHER_TOPICS
        self._volume[topic] = self._volume.get(topic, 0.0) + n
        if topic in self.labelled:
            self._last_seen[topic] = time.monotonic()
            return topic
        if len(self.labelled) < self.limit:
            self.labelled.add(topic)
            self._last_seen[topic] = time.monotonic()
            return topic
        if len(self._volume) > 8 * max(self.limit, 16):
            self._prune(4 * max(self.limit, 16))
        return OTHER_TOPICS

    def label(self, topic: str) -> str:
        """The label value of ``topic`` without counting it (for the table gauges)."""
        if self.allow is not None:
            return topic if topic in self.allow else OTHER_TOPICS
        return topic if topic in self.labelled else OTHER_TOPICS

    def due(self) -> bool:
        return self.allow is None and time.monotonic() >= self._next_rerank

    def rerank(self) -> set[str]:
        """Recompute the labelled set; return the topics that left it."""
        now = time.monotonic()
        self._next_rerank = now + self.rerank_every
        if self.allow is not None:
            return set()
        active = {t for t in self.labelled if now - self._last_seen.get(t, now) < self.idle_after}
        # A labelled topic keeps its place unless an outsider is clearly busier.
        idle = self.labelled - active
        ranked = sorted(
            (t for t, v in self._volume.items() if t in active or (v >= 1.0 and t not in idle)),
            key=lambda t: self._volume[t] * (1.5 if t in active else 1.0),
            reverse=True,
        )
        chosen = set(ranked[: self.limit])
        left = self.labelled - chosen
        for t in chosen - self.labelled:
            self._last_seen[t] = now
        self.labelled = chosen
        for t in left:
            self._last_seen.pop(t, None)
        self._volume = {
            t: v / 2 for t, v in self._volume.items() if t in chosen or (v >= 0.5 and t not in idle)
        }
        return left

    def _prune(self, keep: int) -> None:
        top = sorted(self._volume.items(), key=lambda tv: tv[1], reverse=True)[:keep]
        self._volume = dict(top)
        for t in self.labelled:
            self._volume.setdefault(t, 0.0)


@dataclass
class TableSnapshot:
    """The last reading of the table gauges."""

    backlog: dict[str, int] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    oldest_pending_age: dict[str, float] = field(default_factory=dict)
    truncated: bool = False
    read_at: float | None = None  # time.time() of the last successful read
    read_seconds: float = 0.0
    error: str | None = None


@dataclass(slots=True)
class SlotLag:
    """The replication slot of a WAL relay as last read from the server."""

    lag_bytes: int | None
    wal_status: str | None
    read_at: float


def _slot_families(slot: SlotLag) -> Iterable[GaugeMetricFamily]:
    if slot.lag_bytes is not None:
        yield GaugeMetricFamily(
            "outboxkit_cdc_slot_lag_bytes",
            "WAL written since the slot's confirmed position (current WAL insert position -"
            " confirmed_flush_lsn): what the server keeps for this relay. Lag in seconds:"
            " outboxkit_cdc_lag_seconds.",
            value=slot.lag_bytes,
        )
    yield GaugeMetricFamily(
        "outboxkit_cdc_slot_invalidated",
        "1 when the server invalidated the slot (wal_status lost: max_slot_wal_keep_size"
        " exceeded) or it is missing; see `outboxkit cdc status` for the recovery steps.",
        value=1 if slot.wal_status in ("lost", "missing") else 0,
    )


class RelayMetrics(RelayObserver):
    """Collects a relay's metrics in its own registry; pass it as the relay's observer.

    Every counter comes from the relay's hooks (lease lost, database errors and
    reconnects included); ``attach(relay)`` adds the relay's id and lets /readyz ask
    its publisher whether the broker is reachable; ``run_gauges()`` is the background
    task reading the table.
    """

    def __init__(
        self,
        dsn: str,
        *,
        table: str = "outbox",
        registry: CollectorRegistry | None = None,
        gauge_interval: float = 5.0,
        gauge_row_cap: int = DEFAULT_GAUGE_ROW_CAP,
        process_metrics: bool = True,
        max_topics: int = DEFAULT_MAX_TOPICS,
        topics: Iterable[str] | None = None,
        topic_labels: TopicLabels | None = None,
    ) -> None:
        """``max_topics``: topics with series of their own (the busiest); ``topics``: exactly
        these instead (an allow-list). Every other topic is counted as ``(other)``."""
        self.dsn = dsn
        self.table = table
        self.gauge_interval = gauge_interval
        self.gauge_row_cap = gauge_row_cap
        self.registry = registry if registry is not None else CollectorRegistry()
        self.snapshot = TableSnapshot()
        self.relay_id = ""
        self.last_claim_at: float | None = None
        self.broker_error: str | None = None
        self._broker_error_at = 0.0
        self.publisher: object = None  # set by attach(): its ``reachability``, if any, is read
        # The relay's state (ordered partitions, the WAL relay's stream, a refused role), read
        # at scrape time and by /readyz: set by attach().
        self.status: Callable[[], RelayStatus] = RelayStatus
        #: The database's backend's gauge reader: the table (and a WAL relay's slot) through a
        #: connection it keeps (none until the first reading; the table's name checked now).
        self._gauges = backend_for(dsn).gauge_reader(dsn, table)
        self.topics = topic_labels or TopicLabels(max_topics, allow=topics)
        self._classes: set[str] = set()
        self._other_seen = False
        self._reported: str | None = None  # the not-ready detail last logged
        #: The replication slot as the server last reported it (--source cdc): `slot_lag()`.
        self.slot: SlotLag | None = None
        r = self.registry
        self.published_total = Counter(
            "outboxkit_events_published",
            "Events the broker confirmed.",
            ["topic"],
            registry=r,
        )
        self.failures_total = Counter(
            "outboxkit_publish_failures",
            "Failed publish attempts (each retried or dead-lettered event counts once per try).",
            ["topic", "error_class"],
            registry=r,
        )
        self.retried_total = Counter(
            "outboxkit_events_retried",
            "Failed attempts that were scheduled for another try.",
            ["topic", "error_class"],
            registry=r,
        )
        self.dead_lettered_total = Counter(
            "outboxkit_events_dead_lettered",
            "Events moved to status failed (out of attempts, or rejected for good).",
            ["topic", "error_class"],
            registry=r,
        )
        self.claimed_total = Counter(
            "outboxkit_events_claimed", "Rows claimed (leased) for publishing.", registry=r
        )
        self.publish_latency = Histogram(
            "outboxkit_publish_latency_seconds",
            "From the event's created_at (write commit) to the broker's confirmation.",
            ["topic"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.broker_rtt = Histogram(
            "outboxkit_broker_round_trip_seconds",
            "Time the publisher took to get one batch confirmed by the broker.",
            buckets=RTT_BUCKETS,
            registry=r,
        )
        self.claim_duration = Histogram(
            "outboxkit_claim_duration_seconds",
            "Duration of the claim statement (including empty claims when idle).",
            buckets=CLAIM_SECONDS_BUCKETS,
            registry=r,
        )
        self.batches_total = Counter("outboxkit_batches", "Non-empty batches claimed.", registry=r)
        self.lease_lost_total = Counter(
            "outboxkit_lease_lost",
            "Rows another relay re-claimed before this one settled them (lease too short?).",
            registry=r,
        )
        self.leases_released_total = Counter(
            "outboxkit_leases_released",
            "Leases handed back without publishing: at shutdown, or untried while the broker"
            " was unreachable (their attempt is not counted).",
            registry=r,
        )
        self.db_reconnects_total = Counter(
            "outboxkit_db_reconnects",
            "Database connections lost: the relay reconnected and backed off.",
            registry=r,
        )
        self.db_errors_total = Counter(
            "outboxkit_db_errors",
            "Relay statements that failed on a working connection (a timeout, a lock, a"
            " constraint or trigger); the relay backs off and retries, or the lease expires.",
            registry=r,
        )
        self.claim_batch_size = Histogram(
            "outboxkit_claim_batch_size",
            "Rows returned per non-empty claim.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        r.register(_StateCollector(self))
        if process_metrics:
            ProcessCollector(registry=r)

    def attach(self, relay: Any) -> None:
        """Label the output with the relay's id; read its publisher's reachability."""
        self.relay_id = relay.relay_id
        self.publisher = relay.publisher
        self.status = relay.status

    # -- relay hooks -------------------------------------------------------------

    def claimed(self, count: int, seconds: float) -> None:
        self.last_claim_at = time.monotonic()
        self.claim_duration.observe(seconds)
        if count:
            self.claimed_total.inc(count)
            self.claim_batch_size.observe(count)
            self.batches_total.inc()

    def processed(
        self, messages: Sequence[OutboundMessage], results: Sequence[PublishResult], seconds: float
    ) -> None:
        self.broker_rtt.observe(seconds)
        if not results or any(r.ok or not r.retryable for r in results):
            self.broker_error = None
            return
        # Nothing of the batch confirmed, all retryable: the broker is down or refusing.
        first = results[0]
        self.broker_error = redact(f"{first.error_class or 'error'}: {first.error or ''}")[:300]
        self._broker_error_at = time.monotonic()

    def settled(
        self,
        published: Sequence[OutboundMessage],
        retried: Sequence[Failure],
        dead: Sequence[Failure],
    ) -> None:
        now = dt.datetime.now(dt.UTC)
        labels = self.topics
        per_topic: dict[str, int] = {}
        for m in published:
            topic = labels.count(m.topic)
            per_topic[topic] = per_topic.get(topic, 0) + 1
            self.publish_latency.labels(topic).observe(
                max(0.0, (now - m.created_at).total_seconds())
            )
        for topic, n in per_topic.items():
            self.published_total.labels(topic).inc(n)
        for counter, failures in ((self.retried_total, retried), (self.dead_lettered_total, dead)):
            for message, result in failures:
                topic = labels.count(message.topic)
                cls = self._error_class(result)
                counter.labels(topic, cls).inc()
                self.failures_total.labels(topic, cls).inc()
        if labels.due():
            self._drop_series(labels.rerank())

    def handed_back(self, count: int, error: str | None) -> None:
        self.leases_released_total.inc(count)

    def lost_leases(self, count: int) -> None:
        self.lease_lost_total.inc(count)

    def database_error(self, operation: str, error: Exception, connection_lost: bool) -> None:
        (self.db_reconnects_total if connection_lost else self.db_errors_total).inc()

    def _error_class(self, result: PublishResult) -> str:
        cls = _error_class(result)
        if cls not in self._classes:
            if len(self._classes) >= _MAX_CLASSES:
                return "other"
            self._classes.add(cls)
        return cls

    def _drop_series(self, topics: Iterable[str]) -> None:
        """Remove every series of topics that left the labelled set."""
        for topic in topics:
            self.published_total.remove(topic)
            self.publish_latency.remove(topic)
            for cls in (*self._classes, "other"):
                for counter in (self.failures_total, self.retried_total, self.dead_lettered_total):
                    counter.remove(topic, cls)

    # -- the replication slot (--source cdc) -------------------------------------------

    def slot_lag(self, lag_bytes: int | None, *, wal_status: str | None = None) -> None:
        """Record the slot's lag in bytes (WAL written since its confirmed position) and its
        wal_status; `run_gauges` calls it for a relay with a `cdc` source, anyone may."""
        self.slot = SlotLag(lag_bytes, wal_status, time.time())

    async def refresh_slot(self, gauges: GaugeReader, slot: str) -> None:
        """Read the slot's lag through the backend's gauge reader (one cheap statement)."""
        reading = await gauges.slot(slot)  # (wal_status "missing" when there is no such slot)
        self.slot_lag(reading.lag_bytes, wal_status=reading.wal_status)

    # -- table gauges --------------------------------------------------------------

    async def refresh_gauges(self, gauges: GaugeReader) -> None:
        """Read the table gauges once (two bounded readings, through the backend's reader)."""
        self._rerank()
        started = time.perf_counter()
        rows = await gauges.read(self.gauge_row_cap)
        self._set_gauges(rows.pending, rows.failed, started)

    def _rerank(self) -> None:
        if self.topics.due():  # also when no event settles: idle topics leave the set
            self._drop_series(self.topics.rerank())

    def _set_gauges(
        self,
        pending: Sequence[tuple[Any, ...]],
        failed: Sequence[tuple[Any, ...]],
        started: float,
    ) -> None:
        """The snapshot from (topic, pending, in flight, oldest age) and (topic, failed) rows."""
        snap = TableSnapshot()
        label = self.topics.label
        pending_rows = 0
        for topic, pending_n, in_flight, oldest in pending:
            t = label(topic)
            snap.backlog[t] = snap.backlog.get(t, 0) + pending_n
            snap.in_flight[t] = snap.in_flight.get(t, 0) + in_flight
            age = max(0.0, oldest or 0.0)
            snap.oldest_pending_age[t] = max(snap.oldest_pending_age.get(t, 0.0), age)
            pending_rows += pending_n + in_flight
        failed_rows = 0
        for topic, failed_n in failed:
            t = label(topic)
            snap.failed[t] = snap.failed.get(t, 0) + failed_n
            failed_rows += failed_n
        snap.truncated = pending_rows >= self.gauge_row_cap or failed_rows >= self.gauge_row_cap
        # A labelled topic that drained reports 0 rather than vanishing (alerts compare
        # with 0); a topic that left the labelled set vanishes with its other series.
        self._other_seen = (
            self._other_seen or OTHER_TOPICS in snap.backlog or (OTHER_TOPICS in snap.failed)
        )
        shown = (
            set(self.topics.allow) if self.topics.allow is not None else set(self.topics.labelled)
        )
        if self._other_seen:
            shown.add(OTHER_TOPICS)
        for topic in shown:
            for gauge in (snap.backlog, snap.in_flight, snap.failed, snap.oldest_pending_age):
                gauge.setdefault(topic, 0)
        snap.read_at = time.time()
        snap.read_seconds = time.perf_counter() - started
        self.snapshot = snap

    async def run_gauges(self, stop: asyncio.Event | None = None) -> None:
        """Refresh the table gauges every ``gauge_interval`` seconds until cancelled or stopped.

        One kept connection (the backend's gauge reader: psycopg's, or PyMySQL's on
        MariaDB/MySQL), replaced when a reading fails.
        """
        gauges = self._gauges
        try:
            while stop is None or not stop.is_set():
                try:
                    await self._refresh(gauges)
                except gauges.errors as exc:
                    self.snapshot.error = first_line(exc, with_type=True)
                    log.debug("metrics: reading the table gauges failed: %s", self.snapshot.error)
                    await gauges.close()
                if await self._stopped(stop):
                    return
        finally:
            await gauges.close()

    async def _refresh(self, gauges: GaugeReader) -> None:
        await self.refresh_gauges(gauges)
        cdc = self.status().cdc
        if cdc is not None:
            await self.refresh_slot(gauges, cdc.slot)

    async def _stopped(self, stop: asyncio.Event | None) -> bool:
        """Wait ``gauge_interval`` (or until ``stop`` is set); whether it was set."""
        if stop is None:
            await asyncio.sleep(self.gauge_interval)
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=self.gauge_interval)
        return stop.is_set()

    # -- readiness -------------------------------------------------------------------

    def not_ready_reason(self) -> str | None:
        """None when ready; otherwise why not, for /readyz's body.

        Whoever reaches the port reads it, so it names the kind of failure only
        (an error class), never a server, host, port or role; the full error goes
        to the relay's log, once each time the reason changes.
        """
        snap = self.snapshot
        stale_after = 3 * self.gauge_interval + 5
        reason: str | None = None
        detail: str | None = None
        status = self.status()
        if status.denied is not None:
            # A configuration fault (issue 26, item 5): the relay claims nothing until an
            # operator grants the role its rights or points it at a writable primary.
            reason = f"database refuses the relay's writes ({_kind(status.denied)})"
            detail = f"database refuses the relay's writes: {status.denied}"
        elif snap.error is not None:
            reason, detail = f"database unreachable ({_kind(snap.error)})", snap.error
        elif snap.read_at is None and self.last_claim_at is None:
            reason = "starting: no successful database read yet"
        elif snap.read_at is not None and time.time() - snap.read_at > stale_after:
            reason = f"database reads stale: last success {time.time() - snap.read_at:.0f}s ago"
        elif (down := status.stream_down) is not None and down[0] > stale_after:
            # --source cdc: the same grace as the database's reads, for its replication
            # stream (a standby waiting for the slot is not down: see docs/operations.md)
            reason = f"replication stream down since {down[0]:.0f}s ({_kind(down[1])})"
            detail = f"replication stream down ({down[1]})"
        elif (gone := unreachable(self.publisher)) is not None and gone[0] >= UNREACHABLE_AFTER:
            # The client said so (disconnected, all brokers down): no need to wait for
            # a publish to time out. The cause is a kind of failure, never an address.
            reason = f"broker unreachable for {gone[0]:.0f}s ({_kind(gone[1])})"
            detail = f"broker unreachable: {gone[1]}"
        elif self.broker_error is not None and not restored_since(
            self.publisher, self._broker_error_at
        ):
            # (a publisher that reported its broker back since: the failed batch is history)
            reason = f"broker not confirming ({_kind(self.broker_error)})"
            detail = self.broker_error
        if detail is not None and detail != self._reported:
            log.warning("not ready: %s: %s", reason, detail)
        self._reported = detail
        return reason


def _kind(error: str) -> str:
    """The class name that starts ``"Class: message"``, or a neutral word."""
    head = error.split(":", 1)[0].strip()
    return head if head.isidentifier() and len(head) <= _MAX_CLASS_CHARS else "error"


def _error_class(result: PublishResult) -> str:
    cls = result.error_class or ("rejected" if not result.retryable else "transient")
    return cls[:_MAX_CLASS_CHARS]


class _StateCollector(Collector):
    """Exports the table snapshot and the relay's id at scrape time (no I/O)."""

    def __init__(self, metrics: RelayMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterable[Metric]:
        snap = self.m.snapshot
        for name, doc, values in (
            (
                "outboxkit_backlog",
                "Pending events not leased by a relay (due now or waiting for a retry).",
                snap.backlog,
            ),
            ("outboxkit_in_flight", "Pending events leased by a relay right now.", snap.in_flight),
            ("outboxkit_failed", "Dead-lettered events (status failed).", snap.failed),
            (
                "outboxkit_oldest_pending_age_seconds",
                "Age (now - created_at) of the oldest pending event, per topic.",
                snap.oldest_pending_age,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=["topic"])
            for topic, value in sorted(values.items()):
                family.add_metric([topic], value)
            yield family
        yield GaugeMetricFamily(
            "outboxkit_gauges_truncated",
            "1 when a table gauge query hit its row cap: counts are lower bounds.",
            value=1 if snap.truncated else 0,
        )
        yield GaugeMetricFamily(
            "outboxkit_gauges_read_timestamp_seconds",
            "Unix time of the last successful read of the table gauges.",
            value=snap.read_at or 0,
        )
        yield GaugeMetricFamily(
            "outboxkit_gauges_read_duration_seconds",
            "How long the last read of the table gauges took.",
            value=snap.read_seconds,
        )
        info = GaugeMetricFamily(
            "outboxkit_relay_info", "Constant 1, labelled with the relay id.", labels=["relay_id"]
        )
        info.add_metric([self.m.relay_id or "unknown"], 1)
        yield info
        status = self.m.status()
        owned = status.partitions_owned
        if owned is not None:  # ordered mode
            yield GaugeMetricFamily(
                "outboxkit_partitions_owned",
                "Ordered mode: partitions this relay holds a lease on (0: it cannot heartbeat,"
                " or more relays run than the table has partitions).",
                value=owned,
            )
        if status.cdc is not None:  # --source cdc: the WAL relay's position, read at scrape time
            yield from _cdc_families(status.cdc)
        if self.m.slot is not None:
            yield from _slot_families(self.m.slot)


def _cdc_families(cdc: CdcStatus) -> Iterable[GaugeMetricFamily]:
    """The WAL relay's gauges (outboxkit.cdc.relay.CdcRelay): its stream and its position."""
    yield GaugeMetricFamily(
        "outboxkit_cdc_streaming",
        "1 while this relay streams the slot; 0 as a standby (another relay streams it) or"
        " while reconnecting.",
        value=1 if cdc.streaming else 0,
    )
    yield GaugeMetricFamily(
        "outboxkit_cdc_standby",
        "1 while this relay waits as a standby (another relay streams the slot); with"
        " outboxkit_cdc_streaming 0 and this 0, the relay is reconnecting.",
        value=1 if cdc.standby else 0,
    )
    yield GaugeMetricFamily(
        "outboxkit_cdc_confirmed_lsn",
        "The WAL position this relay last confirmed to the slot (bytes; every event before it"
        " is confirmed by the broker).",
        value=cdc.confirmed_lsn,
    )
    yield GaugeMetricFamily(
        "outboxkit_cdc_lag_seconds",
        "Age of the oldest transaction the relay has received but not yet confirmed"
        " (0: caught up). `outboxkit cdc status` also gives the slot's lag in bytes.",
        value=cdc.lag_seconds,
    )
