"""The lease heartbeat: work that legitimately runs long keeps its items' lease alive.

A batch's rows are leased for ``lease`` seconds at the claim. A publish still running
after a third of it (a slow webhook) extends the lease every ``lease / 3`` seconds, so
the rows are not re-claimed by another relay while this one still publishes them; the
publish timeout alone bounds one publish. A relay that dies stops extending: its rows
come back within one lease, as without the heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from outboxkit._text import first_line
from outboxkit.queue.store import Attempted, Claim, QueueStore, StoreError, StoreUnavailable

T = TypeVar("T", bound=Attempted)


class LeaseHeartbeat:
    """Runs ``extend()`` every ``interval`` seconds from ``interval`` after :meth:`start`.

    A publish shorter than the interval costs one timer, cancelled: no task, no
    statement. :meth:`stop` lets a statement in progress finish instead of cancelling
    it (cancelling a query mid-flight would break the connection it shares with settles).
    """

    __slots__ = ("_extend", "_interval", "_name", "_stopped", "_task", "_timer")

    def __init__(
        self,
        extend: Callable[[], Awaitable[None]],
        interval: float,
        name: str = "outboxkit-relay",
    ) -> None:
        self._extend = extend
        self._name = name
        self._interval = interval
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped: asyncio.Event | None = None

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._interval, self._begin)

    def _begin(self) -> None:
        self._timer = None
        self._stopped = asyncio.Event()
        self._task = asyncio.create_task(self._run(self._stopped), name=f"{self._name}:lease")

    async def _run(self, stopped: asyncio.Event) -> None:
        while not stopped.is_set():
            await self._extend()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), timeout=self._interval)

    async def stop(self) -> None:
        """Stop extending; wait for an extension in progress (cancel it if this is cancelled)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task, self._task = self._task, None
        if task is None:
            return
        assert self._stopped is not None
        self._stopped.set()
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            raise


class _Reports(Protocol):
    def database_error(self, operation: str, error: Exception, connection_lost: bool) -> None: ...


class _Words(Protocol):
    @property
    def items(self) -> str: ...
    @property
    def working(self) -> str: ...


class _Options(Protocol):
    """What an extension reads of ``queue.loop_types.LoopOptions``."""

    @property
    def lease(self) -> float: ...
    @property
    def words(self) -> _Words: ...


class LeaseExtender(Generic[T]):
    """One extension of a claim's leases (what a heartbeat runs, and split mode's runners)."""

    __slots__ = ("log", "observer", "options", "store")

    def __init__(
        self, store: QueueStore[T], observer: _Reports, options: _Options, log: logging.Logger
    ) -> None:
        self.store = store
        self.observer = observer
        self.options = options
        self.log = log

    async def extend(self, claim: Claim[T]) -> int | None:
        """Push the claim's leases to now + lease, fenced by its token: how many it held.

        A failure is logged (None) and the work goes on: the settle copes with a lost lease.
        """
        try:
            held = await self.store.extend_leases(claim, self.options.lease)
        except StoreError as exc:
            self.observer.database_error("extend", exc.cause, isinstance(exc, StoreUnavailable))
            self.log.warning(
                "could not extend the lease of %d %s still %s (%s)",
                len(claim.ids),
                self.options.words.items,
                self.options.words.working,
                first_line(exc.cause),
            )
            return None
        self.log.debug(
            "%s for %.1fs: extended the lease of %d of %d by %.1fs",
            self.options.words.working,
            time.monotonic() - claim.claimed_at,
            held,
            len(claim.ids),
            self.options.lease,
        )
        return held
