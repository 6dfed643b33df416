"""The store failing the claim loop: database errors retried with backoff, refusals waited out.

A lost connection or a failed statement (:class:`DatabaseErrors`) is retried after a
backoff, an outage logged as one episode. A store that refuses the loop's writes (no
privilege, a read-only server: :class:`DeniedWrites`) is a configuration fault: the loop
claims nothing until it accepts them again, and says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from outboxkit._backoff import Backoff
from outboxkit._redact import redact
from outboxkit._text import first_line
from outboxkit.queue.episode import FailureEpisode
from outboxkit.queue.store import QueueStore, StoreDenied, StoreError, StoreUnavailable

Sleep = Callable[[float], Awaitable[None]]


class _ErrorHook(Protocol):
    def database_error(self, operation: str, error: Exception, connection_lost: bool) -> None: ...


class DatabaseErrors:
    """Backoff between a failed store call's retries, and the outage they make."""

    def __init__(self, observer: _ErrorHook, log: logging.Logger, sleep: Sleep) -> None:
        self._observer = observer
        self._log = log
        self._sleep = sleep
        self._backoff = Backoff(base=0.2, cap=10.0)
        self._outage = FailureEpisode("database", logger=log)

    def next_delay(self) -> float:
        return self._backoff.next_delay()

    def reset(self) -> None:
        self._backoff.reset()

    def succeeded(self) -> None:
        """A store call went through: the backoff starts over, an outage ends."""
        self._backoff.reset()
        self._outage.succeeded()

    async def failed(self, what: str, exc: StoreError) -> None:
        """Report ``exc`` and back off before the retry (the store reconnects by itself)."""
        lost = isinstance(exc, StoreUnavailable)
        self._observer.database_error(what, exc.cause, lost)
        delay = self._backoff.next_delay()
        if lost:
            self._outage.failed(
                "database unavailable during %s (%s); reconnecting in %.2fs",
                what,
                first_line(exc.cause),
                delay,
            )
        else:
            # The connection works; the statement failed (a timeout, a lock, a trigger).
            self._log.error(
                "%s failed: %s; retrying in %.2fs",
                what,
                redact(f"{type(exc.cause).__name__}: {exc.cause}"),
                delay,
            )
        await self._sleep(delay)


class DeniedWrites:
    """The store's refusal of the loop's claims or settles, while it lasts.

    ``settling``: refused settles still being retried; while one is, its own success tells
    when the fault is fixed.
    """

    def __init__(
        self,
        store: QueueStore[Any],
        errors: DatabaseErrors,
        log: logging.Logger,
        who: str,
        sleep: Sleep,
    ) -> None:
        self._store = store
        self._errors = errors
        self._log = log
        self._who = who
        self._sleep = sleep
        self.cause: StoreDenied | None = None
        self.settling = 0

    @property
    def reason(self) -> str | None:
        """Why the store refuses the loop's writes (claiming stopped), or None."""
        return None if self.cause is None else first_line(self.cause.cause, with_type=True)

    def deny(self, exc: StoreDenied, what: str) -> None:
        """The store refused ``what``: stop claiming and say so once, in one line."""
        if self.cause is None:
            self._log.error(
                "the database refuses the %s's %s (%s): claiming stopped, nothing is"
                " claimed again until it can settle; grant the role UPDATE and DELETE on"
                " the table (or point --dsn at a writable primary)",
                self._who,
                what,
                first_line(exc.cause, with_type=True),
            )
        self.cause = exc

    def allowed(self) -> None:
        """The store accepted the loop's writes: claim again (unless a settle still fails)."""
        if self.cause is not None and not self.settling:
            self.cause = None
            self._errors.reset()
            self._log.info("the database accepts the %s's writes again: claiming", self._who)

    async def wait_until_allowed(self, stopping: Callable[[], bool]) -> None:
        """Claiming stopped on a configuration fault: check now and then whether it is fixed."""
        await self._sleep(self._errors.next_delay())
        if stopping() or self.settling:
            return  # a settle still refused: its own retries tell when the fault is fixed
        try:
            await self._store.start()
        except StoreDenied as exc:
            self.cause = exc
            return
        except StoreError as exc:
            self._log.debug("checking the %s's rights failed: %s", self._who, first_line(exc.cause))
            return
        self.allowed()
