"""The WAL relay: publishes an outbox from its logical replication slot, in commit order.

The stream carries committed transactions only, in commit order: outbox rows inserted
(the table source) and logical messages under ``outboxkit:<table>`` (``storage="wal"``).
The relay turns them into :class:`OutboundMessage` batches for the same publishers as
the polling relay and confirms the slot (the standby "flush" position) only up to the end
of a transaction all of whose events the broker confirmed (:mod:`outboxkit.cdc.progress`):
killed anywhere, it re-publishes at most that unconfirmed tail.

A stream cannot skip an event and come back to it: a failing event is retried with
backoff while the stream waits, and after ``max_attempts`` is written to the outbox table
as a failed row (the dead letter ``outboxkit failed``/``replay`` work on), then the stream
moves on. A broker outage hands events back untried (attempts not counted): the stream
pauses and the slot keeps the WAL. Another relay streaming the slot makes this one a
standby that takes over when the slot frees up.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import psycopg

from outboxkit._backoff import Backoff
from outboxkit._redact import remember_secrets
from outboxkit._text import first_line
from outboxkit.backends.ports import PoolerMode
from outboxkit.backends.postgres._connection import aconnect, known_pooling, split_pooler
from outboxkit.cdc.cleanup import Cleanup
from outboxkit.cdc.deadletter import DeadLetters
from outboxkit.cdc.decode import is_pending, row_id, row_message
from outboxkit.cdc.envelope import WalEnvelopeError, decode_envelope
from outboxkit.cdc.errors import (
    ReplicationError,
    SlotInUse,
    SlotInvalidated,
    SlotNotFound,
    refuse_without_wal,
)
from outboxkit.cdc.progress import Progress
from outboxkit.cdc.reader import StreamReader
from outboxkit.cdc.slots import default_name
from outboxkit.cdc.stream import Begin, Commit, Keepalive, Message, Row
from outboxkit.errors import ConfigurationError, UndecodableRow, connection_lost
from outboxkit.publishers.base import (
    OutboundMessage,
    Publisher,
    PublishResult,
    batch_shape,
    unreachable,
)
from outboxkit.queue.decide import RetryPolicy, decide, stored_error
from outboxkit.queue.episode import FailureEpisode
from outboxkit.queue.store import Verdict
from outboxkit.sink.observer import (
    Observers,
    RelayObserver,
    RelayStats,
    StatsObserver,
    default_observer,
)
from outboxkit.sink.outage import OutageLog
from outboxkit.sink.publisher import FailureLog, close_publisher, log_stopped, publish
from outboxkit.write.wal_envelope import message_prefix

log = logging.getLogger("outboxkit.relay")

#: Seconds between a standby's reminders that it is still waiting for the slot.
_STANDBY_REMINDER = 300.0

Cleanup_ = Literal["delete", "none"]


@dataclass(slots=True)
class _Entry:
    """One streamed event: its sequence number, message and table row id (None: WAL message)."""

    seq: int
    message: OutboundMessage
    row_id: int | None
    xid: int = 0  # of the transaction (pgoutput's Begin)


class _Stopped(Exception):
    """Raised inside a session when the relay stops with events unconfirmed."""


class CdcRelay:
    """Relays an outbox from its replication slot (``outboxkit cdc setup`` creates both).

    ``slot`` and ``publication`` default to ``outboxkit_<table>``. ``batch_size``
    defaults to the publisher's ``batch_shape``; a batch may span transactions and is
    published only after the previous one's results (order is the point of a stream).
    ``cleanup="delete"`` removes published table rows in bulk before the slot is confirmed
    past them (one ``DELETE`` of the ids published since the last pass, at most one per
    batch; the relay never updates a row on the hot path), or on a partitioned table drops
    the partitions whose rows are all confirmed (``cdc/cleanup.py``); ``"none"`` leaves them.
    """

    def __init__(
        self,
        dsn: str,
        publisher: Publisher,
        *,
        table: str = "outbox",
        slot: str | None = None,
        publication: str | None = None,
        batch_size: int | None = None,
        max_attempts: int = 10,
        retry_base: float = 1.0,
        retry_cap: float = 300.0,
        publish_timeout: float = 24.0,
        cleanup: Cleanup_ = "delete",
        cleanup_interval: float = 5.0,
        standby_retry: float = 1.0,
        relay_id: str | None = None,
        observer: RelayObserver | None = None,
        stats: RelayStats | None = None,
        outage: OutageLog | None = None,
        pooler: PoolerMode | None = None,
    ) -> None:
        refuse_without_wal(dsn)
        if max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        if cleanup not in ("delete", "none"):
            raise ConfigurationError(f"cleanup must be 'delete' or 'none', not {cleanup!r}")
        if not publish_timeout > 0:
            raise ConfigurationError("publish_timeout must be positive")
        batch_size = batch_shape(publisher)[0] if batch_size is None else batch_size
        if batch_size < 1:
            raise ConfigurationError("batch_size must be at least 1")
        remember_secrets(dsn)
        # (the replication connection is libpq's: it knows no ?pooler= option)
        dsn, mode = split_pooler(dsn)
        self.dsn = dsn
        self.pooler: PoolerMode | None = pooler or (None if mode == "auto" else mode)
        self.publisher = publisher
        self.table = table
        self.slot = slot or default_name(table)
        self.publication = publication or default_name(table)
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.retry_base = retry_base
        self.retry_cap = retry_cap
        self.publish_timeout = publish_timeout
        self.standby_retry = standby_retry
        self.relay_id = relay_id or f"cdc:{self.slot}"
        self.prefix = message_prefix(table)
        self.stats = stats if stats is not None else RelayStats()
        if observer is None:
            observer = default_observer()
        if stats is None:  # a Relay delegating here passes its stats and observers as they are
            observer = Observers(StatsObserver(self.stats), observer)
        self.observer = observer
        # Retries and dead letters reach the log through the same hook as the metrics.
        self._settled_hooks = Observers(observer, FailureLog())
        self.outage = outage if outage is not None else OutageLog(max_attempts=max_attempts)
        self.dead_letters = DeadLetters(dsn, table)
        self.cleanup = Cleanup(
            dsn,
            table,
            enabled=cleanup == "delete",
            interval=cleanup_interval,
            confirmed_through=lambda: self.confirmed_commit_time,
        )
        #: The last WAL position confirmed to the slot and the commit time it ended.
        self.confirmed_lsn = 0
        self.confirmed_commit_time: dt.datetime | None = None
        # (end LSN, commit time) of the transactions received and not yet confirmed.
        self._unconfirmed: deque[tuple[int, dt.datetime]] = deque()
        #: Whether this relay streams the slot now (False while a standby or reconnecting).
        self.streaming = False
        #: Whether this relay waits as a standby (another relay streams the slot).
        self.standby = False
        # When the replication stream was last lost, and the class of that error.
        self._stream_lost_at = 0.0
        self._stream_error = ""
        self._stopping = asyncio.Event()
        self._stream_backoff = Backoff(base=0.2, cap=5.0)
        # A database down for a while: one WARNING, reminders, one INFO when it is back.
        self._stream_outage = FailureEpisode("replication stream")
        # An outage hands events back untried; this paces the retries of the stream's head.
        self._broker_backoff = Backoff(base=retry_base, cap=min(retry_cap, 10.0))
        self._running = False

    def __repr__(self) -> str:
        return f"CdcRelay(table={self.table!r}, slot={self.slot!r})"

    def stop(self) -> None:
        """Stop streaming; events published but not confirmed are streamed again next time."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self) -> None:
        """Stream until :meth:`stop`; reconnects through database restarts, waits as standby."""
        if self._running:
            raise RuntimeError("this CdcRelay is already running")
        self._running = True
        self._stopping.clear()
        log.info(
            "cdc relay %s starting: table=%s slot=%s publication=%s publisher=%s batch_size=%d",
            self.relay_id,
            self.table,
            self.slot,
            self.publication,
            self.publisher.name,
            self.batch_size,
        )
        try:
            await self._refuse_pooler()
            await self.cleanup.check()
            await self.publisher.start()
            await self._sessions()
        finally:
            with contextlib.suppress(Exception):
                await self.cleanup.flush(force=True)
            await self.cleanup.close()
            await self.dead_letters.close()
            await close_publisher(self.publisher)
            self._running = False
            log_stopped(f"cdc relay {self.relay_id}", self.stats, released=False)

    async def _refuse_pooler(self) -> None:
        """A transaction pooler carries no replication stream: say so instead of failing
        at every reconnect (an unreachable database is left to the stream's retries)."""
        pooling = known_pooling(self.dsn, self.pooler)
        if pooling is None:
            with contextlib.suppress(psycopg.Error):
                conn = await aconnect(
                    self.dsn, application_name="outboxkit-relay:check", pooler=self.pooler
                )
                await conn.close()
            pooling = known_pooling(self.dsn, self.pooler)
        if pooling is not None and not pooling.session_state:
            raise ConfigurationError(
                "the WAL relay (--source cdc) streams a replication slot, which a transaction"
                " pooler (PgBouncer) cannot carry: point its --dsn at PostgreSQL itself (the"
                " polling relay works through the pooler)"
            )

    async def _sessions(self) -> None:
        standby_since = reminded = 0.0
        while not self._stopping.is_set():
            try:
                await self._session()
            except SlotInUse as exc:
                now = time.monotonic()
                if not self.standby:  # (streaming and a lost stream clear it)
                    standby_since = reminded = now
                    log.info(
                        "standby: slot %s is streamed by another relay (%s); taking over when"
                        " it stops",
                        self.slot,
                        first_line(exc),
                    )
                elif now - reminded >= _STANDBY_REMINDER:
                    reminded = now
                    log.info(
                        "standby: still waiting for slot %s (for %.0fs)",
                        self.slot,
                        now - standby_since,
                    )
                self._waiting_as_standby()
                await self._sleep(self.standby_retry)
            except _Stopped:
                return
            except (SlotNotFound, SlotInvalidated):
                raise  # a restart will not fix these: the messages say what will
            except ReplicationError as exc:
                await self._stream_lost(exc)
            except Exception as exc:
                if not connection_lost(exc):
                    raise
                await self._stream_lost(exc)

    async def _stream_lost(self, exc: BaseException) -> None:
        self.streaming = self.standby = False
        self._stream_lost_at = time.monotonic()
        self._stream_error = type(exc).__name__
        delay = self._stream_backoff.next_delay()
        self._stream_outage.failed(
            "replication stream of slot %s lost (%s); reconnecting in %.2fs",
            self.slot,
            first_line(exc),
            delay,
        )
        if isinstance(exc, Exception):
            self.observer.database_error("stream", exc, True)
        await self._sleep(delay)

    def _waiting_as_standby(self) -> None:
        """A standby has no lost stream: the server answers, another relay streams the slot
        (once no loss for ``recover_after`` seconds: right after one, the slot may still be
        held by this relay's own walsender, on its way out)."""
        self.standby = True
        outage = self._stream_outage
        if outage.started_at is not None and self._stream_up_for(outage.recover_after):
            log.info("replication stream: the server answers again (slot %s is taken)", self.slot)
            self._stream_outage = FailureEpisode("replication stream")

    def _stream_up_for(self, seconds: float) -> bool:
        """Streaming or waiting as a standby, with no loss for ``seconds``."""
        up = self.streaming or self.standby
        return up and time.monotonic() - self._stream_lost_at >= seconds

    def stream_down(self) -> tuple[float, str] | None:
        """Seconds the replication stream has been failing, and the last error's class.

        None before the first failure, and once the relay has streamed (or waited as a
        standby while another relay streams the slot) for the outage's ``recover_after``
        seconds without one: a stream lost again and again (reconnecting, streaming a
        moment, lost) counts as down from the first loss (``queue.episode.FailureEpisode``).
        """
        started = self._stream_outage.started_at
        if started is None or self._stream_up_for(self._stream_outage.recover_after):
            return None
        return time.monotonic() - started, self._stream_error

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    # -- one connection to the slot -------------------------------------------------

    async def _session(self) -> None:
        reader = StreamReader(self.dsn, self.slot, self.publication, capacity=4 * self.batch_size)
        await reader.open()  # raises SlotInUse while another relay streams the slot
        try:
            log.info("streaming slot %s", self.slot)
            self.streaming, self.standby = True, False
            self._stream_backoff.reset()
            await self._stream(reader, Progress())
        finally:
            self.streaming = False
            await reader.close()

    async def _stream(self, reader: StreamReader, progress: Progress) -> None:
        commit_time = dt.datetime.now(dt.UTC)
        xid = 0
        self._unconfirmed.clear()  # a new session streams them again
        held_back: int | None = None  # a confirm waiting for its rows' DELETE
        while True:
            if self._stopping.is_set():
                raise _Stopped
            items = await reader.take(self.batch_size, wait=1.0)
            self._stream_outage.succeeded()  # (returns at once unless an outage is ending)
            batch: list[_Entry] = []
            for item in items:
                if isinstance(item, Row):
                    if not is_pending(item.values):
                        continue  # a dead letter or replayed copy inserted as failed
                    seq = progress.event()
                    try:
                        message = row_message(item.values, commit_time)
                    except UndecodableRow as exc:
                        await self._dead_letter_raw(item.values, str(exc))
                        continue
                    batch.append(_Entry(seq, message, row_id(item.values), xid))
                elif isinstance(item, Message):
                    if item.prefix != self.prefix:
                        continue
                    seq = progress.event()
                    try:
                        message = decode_envelope(item.content, commit_time=commit_time)
                    except WalEnvelopeError as exc:
                        await self._dead_letter_raw(None, str(exc), content=item.content)
                        continue
                    batch.append(_Entry(seq, message, None))
                elif isinstance(item, Begin):
                    progress.begin()
                    commit_time, xid = item.commit_time, item.xid
                elif isinstance(item, Commit):
                    progress.commit(item.end_lsn)
                    self._unconfirmed.append((item.end_lsn, item.commit_time))
                elif isinstance(item, Keepalive):
                    progress.keepalive(item.wal_end)
            if batch:
                self.observer.claimed(len(batch), 0.0)
                self.outage.claimed(len(batch), 0.0)
                await self._deliver(batch)
            elif not items:
                self.observer.claimed(0, 0.0)
            # Every event taken is now published or dead-lettered (written and committed).
            progress.settle(progress.received)
            lsn = progress.confirmable() or held_back
            if lsn is not None:
                # Published rows leave before the slot moves past them: a relay killed
                # after a confirm leaves no published row behind as pending. (A DELETE
                # that failed holds the confirm back until a later pass succeeds.)
                held_back = lsn
                if await self.cleanup.flush(force=True):
                    reader.confirm(lsn)
                    self._confirmed(lsn)
                    held_back = None
            else:
                await self.cleanup.flush()

    def _confirmed(self, lsn: int) -> None:
        self.confirmed_lsn = lsn
        unconfirmed = self._unconfirmed
        while unconfirmed and unconfirmed[0][0] <= lsn:
            self.confirmed_commit_time = unconfirmed.popleft()[1]

    def lag_seconds(self) -> float:
        """Age of the oldest transaction received and not yet confirmed (0: caught up)."""
        if not self._unconfirmed:
            return 0.0
        return max(0.0, (dt.datetime.now(dt.UTC) - self._unconfirmed[0][1]).total_seconds())

    # -- publishing ---------------------------------------------------------------

    async def _deliver(self, batch: list[_Entry]) -> None:
        """Publish ``batch`` until each event is confirmed or dead-lettered, in order.

        Failed events are published again, alone, after a backoff; those that succeeded
        are not. The stream waits meanwhile (it keeps its connection alive itself).
        """
        todo = batch
        while todo:
            messages = [e.message for e in todo]
            with self.observer.processing(messages):
                started = time.perf_counter()
                results = await publish(self.publisher, messages, self.publish_timeout)
                self.observer.processed(messages, results, time.perf_counter() - started)
                self.outage.processed(messages, results, 0.0)
            published = [e for e, r in zip(todo, results, strict=True) if r.ok]
            if published:
                self._broker_backoff.reset()
                self.cleanup.add((e.row_id, e.xid) for e in published if e.row_id is not None)
                if not self.stats.published:
                    log.info(
                        "first batch published: %d event(s) via %s",
                        len(published),
                        self.publisher.name,
                    )
                self.observer.settled([e.message for e in published], (), ())
            if len(published) == len(todo):
                return
            todo, delay = await self._failures(todo, results)
            if todo:
                await self._sleep(delay)
                if self._stopping.is_set():
                    raise _Stopped

    async def _failures(
        self, todo: list[_Entry], results: Sequence[PublishResult]
    ) -> tuple[list[_Entry], float]:
        """Sort failures into dead letters (written now), retries and hand-backs
        (outboxkit.queue.decide: the relay's own decision)."""
        target_down = unreachable(self.publisher) is not None
        # the stream waits in memory, so the relay's own cap bounds a publisher's ask
        policy = RetryPolicy(
            max_attempts=self.max_attempts,
            base=self.retry_base,
            cap=self.retry_cap,
            max_delay=self.retry_cap,
        )
        again: list[_Entry] = []
        dead: list[tuple[_Entry, PublishResult]] = []
        retried: list[tuple[OutboundMessage, PublishResult]] = []
        handed_back = 0
        first_error: str | None = None
        delay = 0.0
        for entry, result in zip(todo, results, strict=True):
            if result.ok:
                continue
            decision = decide(entry.message.attempt, result, policy, target_down=target_down)
            first_error = first_error or decision.error
            delay = max(delay, decision.delay)
            if decision.verdict is Verdict.HAND_BACK:
                handed_back += 1
                again.append(entry)
            elif decision.verdict is Verdict.DEAD:
                dead.append((entry, result))
            else:
                retried.append((entry.message, result))
                entry.message = replace(entry.message, attempt=entry.message.attempt + 1)
                again.append(entry)
        if dead:
            await self._dead_letter(dead)
        if retried or dead:
            self._settled_hooks.settled((), retried, [(e.message, r) for e, r in dead])
        if handed_back:
            delay = max(delay, self._broker_backoff.next_delay())
            self.observer.handed_back(handed_back, first_error)
        return again, delay

    # -- dead letters -------------------------------------------------------------

    async def _dead_letter(self, dead: list[tuple[_Entry, PublishResult]]) -> None:
        """Write each dead letter to the table (its log line comes with the settled hook)."""
        for entry, result in dead:
            error = stored_error(result.error)
            await self._write_dead_letter(
                lambda e=entry, err=error: self.dead_letters.write(
                    e.message, row_id=e.row_id, error=err
                )
            )

    async def _dead_letter_raw(
        self, values: dict[str, bytes | None] | None, error: str, *, content: bytes | None = None
    ) -> None:
        """An event that is not one (undecodable row or envelope) goes to the table as it is."""
        await self._write_dead_letter(
            lambda: self.dead_letters.write_raw(self.prefix, values, content, error)
        )
        log.error("undecodable event dead-lettered: %s", error)
        self.stats.dead_lettered += 1

    async def _write_dead_letter(self, write: Any) -> None:
        """Run one dead-letter write, retrying through database outages: the stream waits."""
        backoff = Backoff(base=0.2, cap=10.0)
        while True:
            try:
                await write()
                return
            except Exception as exc:
                if not connection_lost(exc):
                    raise
                if self._stopping.is_set():
                    raise _Stopped from exc
                self.observer.database_error("dead_letter", exc, True)
                await self._sleep(backoff.next_delay())
