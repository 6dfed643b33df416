"""Ordered mode: each key's events reach the broker in commit (id) order, across relays.

The relay (``Relay(ordered=True)``) hands the claim loop this module's policy, so the
store (backends/postgres/queue_pg.py) claims with ``ordered_claim``
(backends/postgres/ordered_sql.py): a key's row only when every earlier unpublished row of the key
is claimable too, and only in partitions this relay leases (queue/partition_leases.py). A batch
therefore holds a prefix of each key's rows, published in waves: the first event of every key, then
the second of the keys whose first succeeded, and so on; a key's events after a failure are handed
back untried (attempt refunded) and wait behind the failed head's retry. An in-flight row is leased
(available_at > now()), so no other batch, of this relay or another, can claim the key's later rows
until it settles: batches in flight never reorder a key.

Hand-over safety: a batch is claimed only from partitions whose lease lasts longer
than ``margin`` (0.6 x lease), and its waves stop at ``window`` (at most 0.5 x lease)
after the claim started, so the publish ends before the lease can pass to another
relay. Settles are fenced by the claim token and the partition lease (the late settle
of a relay whose lease expired changes nothing: ``lease_lost``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Sequence
from typing import Literal

from outboxkit.backends import backend_for
from outboxkit.backends.ports import PoolerMode
from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.queue.store import HeadsOnly
from outboxkit.sink.publisher import PublisherSink

log = logging.getLogger("outboxkit.relay")

DeadLetterPolicy = Literal["block", "skip"]
DEAD_LETTER_POLICIES: tuple[DeadLetterPolicy, ...] = ("block", "skip")
#: The share of the lease a batch may publish for, and the lease it must have left.
WINDOW_SHARE = 0.5
MARGIN_SHARE = 0.6


def waves(messages: Sequence[OutboundMessage]) -> list[list[int]]:
    """Positions of ``messages`` by wave: keyless and each key's first, then each key's 2nd..."""
    rank: dict[str, int] = {}
    result: list[list[int]] = []
    for i, message in enumerate(messages):
        key = message.key
        n = 0
        if key is not None:
            n = rank.get(key, 0)
            rank[key] = n + 1
        if n == len(result):
            result.append([])
        result[n].append(i)
    return result


class OrderedMode:
    """Ordered mode as the claim loop sees it: a claim policy (outboxkit.queue.loop.Ordering)
    and a sink that publishes each claim in waves through the relay's publisher sink.

    It owns the partition leases (a side task of the loop); the store, built with
    ``ordered=True``, runs the ordered claim and the partition-fenced settles.
    """

    def __init__(
        self,
        dsn: str,
        table: str,
        sink: PublisherSink,
        *,
        relay_id: str,
        lease: float,
        dead_letter_policy: str,
        pooler: PoolerMode | None = None,
        direct_dsn: str | None = None,
        unique_id: bool = False,
    ) -> None:
        if dead_letter_policy not in DEAD_LETTER_POLICIES:
            raise ConfigurationError(
                f"dead_letter_policy must be 'block' or 'skip', not {dead_letter_policy!r}"
            )
        self.inner = sink
        self.policy = dead_letter_policy
        self.lease = lease
        self.window = min(sink.timeout, lease * WINDOW_SHARE)
        self.margin = lease * MARGIN_SHARE
        # A publisher whose client may still deliver after the relay stopped waiting
        # (librdkafka retries until delivery.timeout.ms) is told to give up sooner, and
        # no wave starts later than that bound before the window ends.
        self.delivery_bound = 0.0
        bound = _find(sink.publisher, "bound_delivery_time")
        if callable(bound):
            self.delivery_bound = float(bound(self.window / 2))
        self.leases = backend_for(dsn).partition_leases(
            dsn, table, relay_id, lease, pooler=pooler, direct_dsn=direct_dsn, unique_id=unique_id
        )
        self._open: dict[asyncio.Task[None], float] = {}
        self._starts: dict[uuid.UUID, tuple[float, int]] = {}
        self._claim_started = 0.0

    # -- the claim policy -------------------------------------------------------------

    def before_claim(self, token: uuid.UUID, limit: int) -> HeadsOnly:
        """The ordered claim's policy; called as each claim starts."""
        now = time.monotonic()
        self._claim_started = now
        if len(self._starts) > 64:  # tokens of claims that returned nothing
            horizon = now - 2 * self.lease
            self._starts = {t: s for t, s in self._starts.items() if s[0] > horizon}
        self._starts[token] = (now, self.leases.losses)
        self._release_drained()
        return HeadsOnly(
            block=self.policy == "block",
            margin=self.margin,
            draining=tuple(self.leases.draining),
        )

    def track(self, task: asyncio.Task[None]) -> None:
        """Remember the batch task of the claim that just returned, until it is done."""
        self._open[task] = self._claim_started
        task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._open.pop(task, None)

    def _release_drained(self) -> None:
        """Draining partitions no batch claimed before their drain began still holds."""
        draining = self.leases.draining
        if not draining:
            return
        oldest = min(self._open.values(), default=math.inf)
        ready = [p for p, since in draining.items() if oldest >= since]
        if ready:
            self.leases.release_soon(ready)

    # -- the sink -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.inner.name

    def target_down(self) -> bool:
        return self.inner.target_down()

    def restored_since(self, when: float) -> bool:
        return self.inner.restored_since(when)

    def dead_outcome(self, error: str, error_class: str) -> PublishResult:
        return self.inner.dead_outcome(error, error_class)

    async def process(
        self, token: uuid.UUID, messages: Sequence[OutboundMessage]
    ) -> list[PublishResult]:
        """Publish a claim in waves; results in the claim's order."""
        # (a batch not claimed through before_claim() gets no time at all)
        started, losses = self._starts.pop(token, (-math.inf, -1))
        fixed = started + self.window
        results: list[PublishResult | None] = [None] * len(messages)
        failed: set[str] = set()
        for wave in waves(messages):
            todo = [i for i in wave if messages[i].key not in failed]
            if not todo:
                continue
            remaining = self._deadline(fixed, losses) - time.monotonic()
            if remaining <= self.delivery_bound or remaining <= 0:
                break  # the rest is handed back untried: the lease could pass on meanwhile
            try:
                async with asyncio.timeout(remaining):
                    wave_results = await self.inner.publish([messages[i] for i in todo])
            except TimeoutError:
                error = f"publish not confirmed within the ordered window ({self.window:.1f}s)"
                wave_results = [PublishResult.retry(error, "publish_timeout")] * len(todo)
            for i, result in zip(todo, wave_results, strict=True):
                results[i] = result
                key = messages[i].key
                if not result.ok and key is not None:
                    failed.add(key)
        return [
            r if r is not None else _untried(messages[i].key in failed)
            for i, r in enumerate(results)
        ]

    def _deadline(self, fixed: float, losses: int) -> float:
        """When the waves of a batch must have ended.

        ``fixed``: the claim saw the lease last ``margin`` past its start, so the window
        from the claim's start is safe whatever happens next. Later, as long as no
        heartbeat since the claim found a held partition taken, every partition of the
        batch was renewed by the last heartbeat: the publish may go on until that
        renewal's lease (a slow claim or broker does not make every batch hand back).
        """
        if self.leases.losses != losses:
            return fixed
        return max(fixed, self.leases.safe_until())

    # -- partitions ---------------------------------------------------------------

    async def check_schema(self) -> None:
        await self.leases.check_schema()

    async def run(self) -> None:
        """The partition heartbeat (a side task of the relay)."""
        log.info(
            "ordered mode: dead_letter_policy=%s publish window %.1fs of a %.1fs lease",
            self.policy,
            self.window,
            self.lease,
        )
        await self.leases.run()

    def owned_count(self) -> int:
        return self.leases.owned_count()


def _find(publisher: object, name: str) -> object:
    """``name`` of ``publisher`` or of the publisher it wraps (``.inner``: routing)."""
    for _ in range(8):
        found = getattr(publisher, name, None)
        if found is not None or not hasattr(publisher, "inner"):
            return found
        publisher = publisher.inner
    return None


_AFTER_FAILURE = PublishResult.hand_back(
    "not tried: an earlier event of its key failed in this batch (ordered mode)",
    "ordered_untried",
)
_WINDOW_ENDED = PublishResult.hand_back(
    "not tried: the batch's publish window ended (ordered mode)", "ordered_untried"
)


def _untried(after_failure: bool) -> PublishResult:
    return _AFTER_FAILURE if after_failure else _WINDOW_ENDED
