"""Hooks the relay calls at each step, so metrics, traces and logs stay out of its loops.

The engine calls one :class:`RelayObserver`; :class:`Observers` fans out to several.
Every hook must be cheap and must not raise: it runs on the relay's hot path.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from outboxkit._redact import redact
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.tracing import available as tracing_available
from outboxkit.tracing import batch_span, record_batch_outcome

log = logging.getLogger("outboxkit.relay")

_MAX_ERROR_CHARS = 2000

#: The observer hooks renamed when the task worker began to share them: old name, new name.
_RENAMED = {"publishing": "processing", "published": "processed"}

#: A failed message with the attempt number it failed on.
Failure = tuple[OutboundMessage, PublishResult]


class RelayObserver:
    """No-op base: subclass and override the hooks you need."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The hooks around a batch's publish are the queue core's (queue/loop.py
        # QueueObserver), named for the task worker's handlers too: a subclass still
        # overriding their old names would be skipped without a word, so it is refused.
        super().__init_subclass__(**kwargs)
        old = [name for name in _RENAMED if callable(vars(cls).get(name))]
        if old:
            raise TypeError(
                f"{cls.__qualname__} overrides RelayObserver.{old[0]}, renamed"
                f" {_RENAMED[old[0]]} (CHANGELOG, fourth wave): rename the method"
            )

    def claimed(self, count: int, seconds: float) -> None:
        """A claim statement returned ``count`` rows (0 when idle) in ``seconds``."""

    @contextlib.contextmanager
    def processing(self, messages: Sequence[OutboundMessage]) -> Iterator[None]:
        """Wraps one batch's publish (tracing opens its batch span here); the claim loop's
        ``processing`` hook (the task worker's runs handlers)."""
        yield

    def processed(
        self, messages: Sequence[OutboundMessage], results: Sequence[PublishResult], seconds: float
    ) -> None:
        """The broker answered a batch (``seconds`` = broker round trip), before settling."""

    def settled(
        self,
        published: Sequence[OutboundMessage],
        retried: Sequence[Failure],
        dead: Sequence[Failure],
    ) -> None:
        """Outcomes the table now holds: called after the settle statement committed,
        with only the rows it changed (rows another relay re-claimed go to :meth:`lost_leases`).
        A batch with both outcomes settles in two statements, so two calls."""

    def handed_back(self, count: int, error: str | None) -> None:
        """``count`` leases handed back unpublished, their attempt refunded: untried while
        the broker was unreachable (``error`` says why), or at shutdown (``error`` is None)."""

    def lost_leases(self, count: int) -> None:
        """``count`` rows were re-claimed by another relay before this one settled them."""

    def database_error(self, operation: str, error: Exception, connection_lost: bool) -> None:
        """A statement of ``operation`` (claim, settle, release) failed. ``connection_lost``:
        the relay drops the connection, reconnects and backs off; otherwise the statement
        itself failed (a timeout, a constraint, a trigger) on a connection that still works."""


class Observers(RelayObserver):
    """Several observers behind one; a failing observer is logged, never propagated."""

    def __init__(self, *observers: RelayObserver) -> None:
        self.observers = list(observers)

    def claimed(self, count: int, seconds: float) -> None:
        for o in self.observers:
            _safely(o.claimed, count, seconds)

    @contextlib.contextmanager
    def processing(self, messages: Sequence[OutboundMessage]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for o in self.observers:
                try:
                    stack.enter_context(o.processing(messages))
                except Exception:
                    log.exception("relay observer %r failed", o)
            yield

    def processed(
        self, messages: Sequence[OutboundMessage], results: Sequence[PublishResult], seconds: float
    ) -> None:
        for o in self.observers:
            _safely(o.processed, messages, results, seconds)

    def settled(
        self,
        published: Sequence[OutboundMessage],
        retried: Sequence[Failure],
        dead: Sequence[Failure],
    ) -> None:
        for o in self.observers:
            _safely(o.settled, published, retried, dead)

    def handed_back(self, count: int, error: str | None) -> None:
        for o in self.observers:
            _safely(o.handed_back, count, error)

    def lost_leases(self, count: int) -> None:
        for o in self.observers:
            _safely(o.lost_leases, count)

    def database_error(self, operation: str, error: Exception, connection_lost: bool) -> None:
        for o in self.observers:
            _safely(o.database_error, operation, error, connection_lost)


def _safely(hook: object, *args: object) -> None:
    try:
        hook(*args)  # type: ignore[operator]
    except Exception:
        log.exception("relay observer hook %r failed", hook)


@dataclass
class RelayStats:
    """Counters since start; cheap to read from another task (tests, demo, bench).

    Fed only through the observer hooks (:class:`StatsObserver`), like metrics: they
    count what the table holds, ``published`` once the settle committed. (The counters
    are not hooks themselves because ``claimed`` and ``published`` are names of both.)
    """

    claimed: int = 0
    published: int = 0
    retried: int = 0
    dead_lettered: int = 0
    released: int = 0  # leases handed back unpublished (at shutdown, or untried in an outage)
    lease_lost: int = 0
    batches: int = 0
    db_reconnects: int = 0  # connections lost (the relay reconnected and backed off)
    db_errors: int = 0  # statements that failed on a working connection (not reconnects)
    last_error: str | None = None
    started_at: float = field(default_factory=time.monotonic)


class StatsObserver(RelayObserver):
    """Counts the hooks into a :class:`RelayStats` (every relay has one: ``relay.stats``)."""

    def __init__(self, stats: RelayStats | None = None) -> None:
        self.stats = stats if stats is not None else RelayStats()

    def claimed(self, count: int, seconds: float) -> None:
        if count:
            self.stats.claimed += count
            self.stats.batches += 1

    def settled(
        self,
        published: Sequence[OutboundMessage],
        retried: Sequence[Failure],
        dead: Sequence[Failure],
    ) -> None:
        stats = self.stats
        stats.published += len(published)
        if retried or dead:
            stats.retried += len(retried)
            stats.dead_lettered += len(dead)
            first = (retried or dead)[0][1]
            stats.last_error = redact(first.error or "unknown error")[:_MAX_ERROR_CHARS]

    def handed_back(self, count: int, error: str | None) -> None:
        self.stats.released += count
        if error is not None:
            self.stats.last_error = error

    def lost_leases(self, count: int) -> None:
        self.stats.lease_lost += count

    def database_error(self, operation: str, error: Exception, connection_lost: bool) -> None:
        if connection_lost:
            self.stats.db_reconnects += 1
        else:
            self.stats.db_errors += 1


class SummaryLog(RelayObserver):
    """One INFO line per ``interval`` with what the relay did since the last one.

    Publish failures are logged as outages (sink/outage.py: a WARNING when they start,
    an INFO when they end; each failure at DEBUG) and dead letters one ERROR each; this
    keeps the steady state to a line per interval however many batches flow.
    """

    def __init__(self, interval: float = 30.0) -> None:
        self.interval = interval
        self._since = time.monotonic()
        self._claims = self._claimed = self._published = self._retried = self._dead = 0
        self._claim_seconds = 0.0

    def claimed(self, count: int, seconds: float) -> None:
        self._claims += 1
        self._claimed += count
        self._claim_seconds += seconds
        self._maybe_log()

    def settled(
        self,
        published: Sequence[OutboundMessage],
        retried: Sequence[Failure],
        dead: Sequence[Failure],
    ) -> None:
        self._published += len(published)
        self._retried += len(retried)
        self._dead += len(dead)
        self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.interval:
            return
        if self._claimed or self._published or self._retried or self._dead:
            log.info(
                "relay summary: %d claims (%.1f ms avg) claimed=%d published=%d retried=%d"
                " dead_lettered=%d in %.0fs (%.1f events/s)",
                self._claims,
                1000 * self._claim_seconds / max(self._claims, 1),
                self._claimed,
                self._published,
                self._retried,
                self._dead,
                elapsed,
                self._published / elapsed,
                extra={
                    "claims": self._claims,
                    "claimed": self._claimed,
                    "published": self._published,
                    "retried": self._retried,
                    "dead_lettered": self._dead,
                    "interval_s": round(elapsed, 3),
                },
            )
        self._since = now
        self._claims = self._claimed = self._published = self._retried = self._dead = 0
        self._claim_seconds = 0.0


class BatchTracing(RelayObserver):
    """One OpenTelemetry span per published batch, linked to each event's write-time trace."""

    def __init__(self, system: str = "") -> None:
        self.system = system

    @contextlib.contextmanager
    def processing(self, messages: Sequence[OutboundMessage]) -> Iterator[None]:
        with batch_span(messages, self.system):
            yield

    def processed(
        self, messages: Sequence[OutboundMessage], results: Sequence[PublishResult], seconds: float
    ) -> None:
        failures = [r for r in results if not r.ok]
        error = redact(f"{failures[0].error_class}: {failures[0].error}") if failures else None
        record_batch_outcome(len(results) - len(failures), len(failures), error)


def default_observer() -> RelayObserver:
    """Summary logs, plus batch spans when opentelemetry is installed."""
    if tracing_available():
        return Observers(SummaryLog(), BatchTracing())
    return SummaryLog()
