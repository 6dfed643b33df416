"""One log line per interval for things a client can make happen as often as it likes."""

from __future__ import annotations

import logging
import time
from typing import Any


class Throttled:
    """Logs to ``logger`` at most once per ``interval`` seconds, saying how many were held back."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last = -interval
        self._held = 0

    def __call__(self, level: int, msg: str, *args: Any, **kwargs: Any) -> bool:
        """Log unless a line went out less than ``interval`` ago; True when it was logged."""
        now = time.monotonic()
        if now - self._last < self.interval:
            self._held += 1
            return False
        held, self._held, self._last = self._held, 0, now
        if held:
            msg += f" ({held} more since the last such line)"
        self.logger.log(level, msg, *args, **kwargs)
        return True
