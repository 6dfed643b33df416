"""Small pieces several publishers share."""

from __future__ import annotations

import logging
import time
from typing import Any

from outboxkit.publishers.base import PublishResult


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


def too_large(
    broker: str, size: int, counted: str, limit_text: str, limit: int, fix: str
) -> PublishResult:
    """The dead letter of a message over its broker's size limit, naming both numbers.

    Sent anyway, such a message fails on every try and, on some brokers, takes its
    connection (NATS) or channel (RabbitMQ) with it, failing its neighbours too: it is
    judged alone, before it is sent. ``counted`` says what the size includes.
    """
    return PublishResult.permanent(
        f"{broker}: message is {_grouped(size)} bytes {counted}; {limit_text} is"
        f" {_grouped(limit)} ({fix})",
        "message_too_large",
    )


def _grouped(n: int) -> str:
    """``1048576`` as ``1 048 576``: sizes near a limit are read digit by digit."""
    return f"{n:,}".replace(",", " ")
