"""Exceptions as one short phrase for a log line or a stored error, secrets masked."""

from __future__ import annotations

from outboxkit._redact import redact


def describe(exc: BaseException) -> str:
    """``Type: message`` (``Type`` alone when the message is empty), redacted."""
    text = str(exc).strip()
    return redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def first_line(exc: BaseException, *, with_type: bool = False) -> str:
    """The first line of ``exc``'s message, redacted: a server error's DETAIL, HINT and
    context lines dropped, for one log line. Without a message: the type's name.
    ``with_type``: ``Type: first line``."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    name = type(exc).__name__
    if with_type:
        return redact(f"{name}: {line}" if line else name)
    return redact(line or name)
