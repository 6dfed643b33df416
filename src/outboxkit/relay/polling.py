"""The polling relay: the queue core's claim loop with the publisher as its sink.

The outbox table is its store (backends/postgres/queue_pg.py, or MariaDB's); ordered mode
(per-key order through partition leases, relay/ordered.py) is a claim policy and a sink
that publishes in waves, with the partition heartbeat as a side task.

No database transaction or row lock is held while a broker is talked to: the claim is one
short statement that leases rows, the publish happens with no transaction open, the settle
is one short statement per outcome fenced by the claim's token. A relay that dies leaves
leases that simply expire.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from outboxkit._text import first_line
from outboxkit.maintenance.side_task import partition_side_task
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.queue.decide import RetryPolicy
from outboxkit.queue.loop import ClaimLoop, LoopOptions
from outboxkit.queue.store import QueueStore, StoreDenied, StoreError
from outboxkit.relay.ordered import DeadLetterPolicy, OrderedMode
from outboxkit.relay.status import RelayStatus
from outboxkit.sink.observer import Observers
from outboxkit.sink.publisher import FailureLog, PublisherSink, close_publisher, log_stopped

if TYPE_CHECKING:
    from outboxkit.relay.engine import Relay

log = logging.getLogger("outboxkit.relay")
# The relay's gather window (queue/loop.py LoopOptions.gather): at a steady few hundred
# events/s a claim waits up to 10 ms for more, several events a claim and settle instead
# of one or two, inside issue 42's 25 ms p99 budget (bench/relay_steady.py).
GATHER_WINDOW = 0.01

_SideTask = tuple[str, Callable[[], Coroutine[Any, Any, None]]]


class PollingSource:
    """Claims the relay's rows from the outbox table and publishes them (``source="poll"``)."""

    def __init__(
        self,
        relay: Relay,
        *,
        dead_letter_policy: DeadLetterPolicy,
        unique_id: bool,
    ) -> None:
        self.relay = relay
        self.store: QueueStore[OutboundMessage] = relay.backend.queue_store(
            relay.dsn,
            relay.table,
            OutboundMessage,
            retention=relay.retention,
            ordered=relay.ordered,
            synchronous_commit=relay.synchronous_commit,
            pooler=relay.pooler,
            direct_dsn=relay.direct_dsn,
        )
        sink = PublisherSink(relay.publisher, relay.publish_timeout)
        self.ordered = (
            OrderedMode(
                relay.dsn,
                relay.table,
                sink,
                relay_id=relay.relay_id,
                lease=relay.lease,
                dead_letter_policy=dead_letter_policy,
                pooler=relay.pooler,
                direct_dsn=relay.direct_dsn,
                unique_id=unique_id,
            )
            if relay.ordered
            else None
        )
        options = LoopOptions(
            owner=relay.relay_id,
            batch_size=relay.batch_size,
            max_in_flight=relay.max_in_flight,
            lease=relay.lease,
            poll_interval=relay.poll_interval,
            linger=relay.linger,
            gather=min(GATHER_WINDOW, relay.linger),
            listen=relay.listen,
            shutdown_timeout=relay.shutdown_timeout,
            retry=RetryPolicy(
                max_attempts=relay.max_attempts, base=relay.retry_base, cap=relay.retry_cap
            ),
        )
        self.loop: ClaimLoop[OutboundMessage, PublishResult] = ClaimLoop(
            self.store,
            sink if self.ordered is None else self.ordered,
            Observers(relay.observer, relay.outage, FailureLog()),
            options,
            ordering=self.ordered,
            side_tasks=self._side_tasks(),
            logger=log,
        )
        self.loop.first_settled = self._first_batch
        self._running = False

    def stop(self) -> None:
        self.loop.stop()

    @property
    def stopping(self) -> bool:
        return self.loop.stopping.is_set()

    async def run(self) -> None:
        if self._running:
            raise RuntimeError("this Relay is already running")
        relay = self.relay
        self._running = True
        publisher_started = False
        try:
            log.info(
                "relay %s starting: table=%s publisher=%s batch_size=%d max_in_flight=%d"
                " lease=%.1fs synchronous_commit=%s",
                relay.relay_id,
                relay.table,
                relay.publisher.name,
                relay.batch_size,
                relay.max_in_flight,
                relay.lease,
                "on" if relay.synchronous_commit else "off",
            )
            # The table first: a missing table fails here, before any broker is contacted.
            await self._check_table()
            publisher_started = True  # a start that fails half-way may hold a connection
            await relay.publisher.start()
            log.info("publisher %s started; claiming batches", relay.publisher.name)
            await self.loop.run()
        finally:
            await self.store.close()
            if publisher_started:
                await close_publisher(relay.publisher)
            self._running = False
            log_stopped(f"relay {relay.relay_id}", relay.stats, released=True)

    def _side_tasks(self) -> list[_SideTask]:
        relay = self.relay
        tasks: list[_SideTask] = []
        # A partitioned outbox: partitions ahead, expired ones dropped (maintenance/
        # side_task.py; returns at once on a plain table). None: no time partitions there.
        # (Its advisory lock is a session's: PostgreSQL itself when given.)
        chore = relay.backend.partition_chore(relay.direct_dsn or relay.dsn, relay.table)
        if chore is not None:
            tasks.append(
                (
                    "outboxkit-relay:time-partitions",
                    lambda: partition_side_task(chore, self.loop.stopping),
                )
            )
        if self.ordered is not None:  # ordered mode's partition leases (queue/partition_leases.py)
            tasks.append(("outboxkit-relay:partition-leases", self.ordered.run))
        return tasks

    @property
    def partitions_owned(self) -> int | None:
        return None if self.ordered is None else self.ordered.owned_count()

    def status(self) -> RelayStatus:
        loop = self.loop.status()
        return RelayStatus(denied=loop.denied, partitions_owned=self.partitions_owned)

    def _first_batch(self, count: int, seconds: float) -> None:
        log.info(
            "first batch published: %d event(s) via %s in %.0f ms",
            count,
            self.relay.publisher.name,
            1000 * seconds,
        )

    async def _check_table(self) -> None:
        """Say what the relay found at start; raise if the table is missing.

        An unreachable database is not fatal here: the claim loop retries it. A role that
        cannot settle (no UPDATE or DELETE, a read-only server) is refused: the loop
        claims nothing until it can (issue 26, item 5).
        """
        try:
            info = await self.store.start()
            if self.ordered is not None:
                await self.ordered.check_schema()  # SchemaError: run migrate --ordered
        except StoreDenied as exc:
            self.loop.deny(exc, "settles")
            return
        except StoreError as exc:
            if (refused := self.relay.backend.refusal(exc.cause)) is not None:
                raise refused from None
            log.warning("database not reachable at start (%s); retrying", first_line(exc.cause))
            return
        log.info(
            "connected to %s; table %s found with %s%d pending event(s)",
            info.where,
            self.relay.table,
            "at least " if info.pending_capped else "",
            info.pending,
        )
