"""A condition failing again and again (a database unreachable), logged as a few lines."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("outboxkit.relay")


class FailureEpisode:
    """A condition failing again and again (the database unreachable) as a few lines.

    The first failure is logged as given (WARNING), repeats at DEBUG with a WARNING
    reminder every ``remind_every`` seconds, and a success once nothing has failed for
    ``recover_after`` seconds ends it with one INFO (one connection reconnecting while
    another is still to fail is not the end).
    """

    def __init__(
        self,
        what: str,
        *,
        remind_every: float = 30.0,
        recover_after: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        self.what = what
        self._log = logger or log
        self.remind_every = remind_every
        self.recover_after = recover_after
        self._clock = clock
        self.started_at: float | None = None
        self.failures = 0
        self._last_report = self._last_failure = 0.0

    def failed(self, message: str, *args: object, exc_info: BaseException | None = None) -> None:
        """Log ``message % args`` at WARNING if it starts the episode or is due as a reminder.

        ``exc_info``: a traceback for the episode's first line only (a bug's, told once).
        """
        now = self._clock()
        self._last_failure = now
        self.failures += 1
        if self.started_at is None:
            self.started_at = self._last_report = now
            self.failures = 1
            self._log.warning(message, *args, exc_info=exc_info)
        elif now - self._last_report >= self.remind_every:
            self._last_report = now
            self._log.warning(
                "%s still failing after %.0fs (%d failures): " + message,
                self.what,
                now - self.started_at,
                self.failures,
                *args,
            )
        else:
            self._log.debug(message, *args)

    def succeeded(self) -> None:
        if self.started_at is None or self._clock() - self._last_failure < self.recover_after:
            return
        self._log.info(
            "%s back after %.0fs (%d failures)",
            self.what,
            self._last_failure - self.started_at,
            self.failures,
        )
        self.started_at = None
