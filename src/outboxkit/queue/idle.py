"""Connections left idle: the timer that closes them, and how long a fleet keeps a claim one.

A fleet process (outboxkit.fleet) serves many databases, most of them idle most of the time,
and every connection an idle one holds counts against its server's ``max_connections``. The
fleet sets :data:`claim_idle` for each database's service (a context variable: the tasks of
that service read it); a store that can closes its claim connection once its claims found
nothing for that long, and waits on a session it holds anyway (PostgreSQL: its LISTEN
session, backends/postgres/_pg_session.py). None, a single relay's or worker's: kept open.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from contextvars import ContextVar

#: A settle connection not asked anything for this long is closed (the next settle opens
#: one): a database with nothing to publish then holds no settle connection, which counts in
#: a fleet of many mostly idle databases (docs/fleet.md).
SETTLE_IDLE = float(os.environ.get("OUTBOXKIT_SETTLE_IDLE", "30"))
#: Seconds a claim connection that finds nothing stays open (None: for good).
claim_idle: ContextVar[float | None] = ContextVar("outboxkit_claim_idle", default=None)


class IdleTimer:
    """Calls ``expire`` once :meth:`used` was not called for ``seconds`` (None: never).

    One timer per connection, pushed back by nothing: at its end it looks at the last use
    and waits the rest. ``expire`` returns None when done (the connection closed, or
    nothing to close), or the seconds after which to ask again (it was busy).
    """

    def __init__(self, seconds: float | None, expire: Callable[[], float | None]) -> None:
        self.seconds = seconds
        self._expire = expire
        self._used = 0.0  # (the event loop's clock)
        self._timer: asyncio.TimerHandle | None = None

    def used(self) -> None:
        if self.seconds is None:
            return
        loop = asyncio.get_running_loop()
        self._used = loop.time()
        if self._timer is None:
            self._timer = loop.call_later(self.seconds, self._fire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        if self.seconds is None:
            return
        loop = asyncio.get_running_loop()
        idle = loop.time() - self._used
        again = self.seconds - idle if idle < self.seconds else self._expire()
        if again is not None:
            self._timer = loop.call_later(max(again, 0.1), self._fire)
