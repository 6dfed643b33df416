"""The exceptions outboxkit raises: one root, a few meaningful subclasses."""

from __future__ import annotations


class OutboxkitError(Exception):
    """Root of every exception outboxkit raises on purpose."""


class NotInTransactionError(OutboxkitError):
    """An outbox write was attempted outside an open database transaction.

    Writing outside the caller's transaction would bring back the dual-write
    problem the outbox exists to remove, so it is refused and nothing is written.
    """


class InvalidEventError(OutboxkitError, ValueError):
    """An event failed validation at write time; nothing was written."""


class ConfigurationError(OutboxkitError, ValueError):
    """An option, URL or identifier given to outboxkit is not valid."""


class SchemaError(OutboxkitError):
    """The outbox table is missing or older than this release expects."""
