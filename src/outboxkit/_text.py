"""Exceptions as one short phrase for a log line or a stored error, secrets masked."""

from __future__ import annotations

from outboxkit._redact import redact


def describe(exc: BaseException) -> str:
    """``Type: message`` (``Type`` alone when the message is empty), redacted."""
    text = str(exc).strip()
    return redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
