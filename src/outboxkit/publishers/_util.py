"""Small pieces several publishers share."""

from __future__ import annotations

import logging
import time
from typing import Any


class ThrottledLog:
    """WARNINGs at most once per ``interval`` seconds.

    A broker client reports a lost connection from a callback that can fire many times
    a second (each reconnect attempt, each channel): one line per interval says it.
    """

    def __init__(self, log: logging.Logger, interval: float = 10.0) -> None:
        self._log = log
        self._interval = interval
        self._last = float("-inf")

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._last = now
            self._log.warning(msg, *args)
