"""Items handed back untried while the sink's target is unreachable, due again once it is back.

An outage must not dead-letter healthy items, so their attempts are not counted and their
own backoff does not grow; this one does, per loop, until the target answers. What was
handed back meanwhile is remembered by id and made due at once (``store.hasten``) when the
target is back, instead of waiting out the last backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from outboxkit._backoff import Backoff
from outboxkit._text import first_line
from outboxkit.queue.decide import RetryPolicy
from outboxkit.queue.store import QueueStore, StoreError

#: Items handed back in an outage remembered by id, to make them due once it ends.
MAX_HANDED_BACK = 200_000


class _Target(Protocol):
    """What the hand-back reads of the sink (``queue.loop.Sink``)."""

    @property
    def name(self) -> str: ...

    def restored_since(self, when: float) -> bool: ...


class HandBack:
    """The outage's pace (a backoff per loop) and the ids it handed back."""

    def __init__(
        self,
        store: QueueStore[Any],
        target: _Target,
        retry: RetryPolicy,
        log: logging.Logger,
        wake: Callable[[], None],
    ) -> None:
        self._store = store
        self._target = target
        self._log = log
        self._wake = wake
        self._backoff = Backoff(base=retry.base, cap=retry.cap)
        self._ids: set[int] = set()
        self._at = 0.0

    @property
    def waiting(self) -> bool:
        """Items handed back in an outage wait to be made due."""
        return bool(self._ids)

    def delay(self, state: bool | None) -> float:
        """The hand-back delay of a claim whose outcomes say ``state`` (``decide.outage``):
        the target is down (the backoff grows), up (it resets) or unknown (no delay)."""
        if state is False:
            self._backoff.reset()
        elif state:
            return self._backoff.next_delay()
        return 0.0

    def succeeded(self) -> None:
        """Every item of a claim went through: the target is up."""
        self._backoff.reset()

    def remember(self, ids: Sequence[int], delay: float) -> None:
        """``ids`` were handed back with ``delay``: hasten them when the target is back."""
        if delay > 0 and len(self._ids) < MAX_HANDED_BACK:
            self._ids.update(ids)
            self._at = time.monotonic()

    def target_restored(self) -> bool:
        """The sink reported its target back since the last hand-back."""
        return bool(self._ids) and self._target.restored_since(self._at)

    async def target_back(self) -> None:
        """The target is back: items handed back during its outage are due at once."""
        ids = list(self._ids)
        self._ids.clear()
        try:
            count = await self._store.hasten(ids)
        except StoreError as exc:
            self._log.debug("could not make handed-back items due: %s", first_line(exc.cause))
            return
        if count:
            self._log.info(
                "%s is back: %d event(s) handed back during the outage are due now",
                self._target.name,
                count,
            )
            self._wake()
