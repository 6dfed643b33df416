"""Task mode's exceptions: a bad payload or task name at enqueue, and a lost lease."""

from __future__ import annotations

from outboxkit.errors import OutboxkitError


class InvalidTaskError(OutboxkitError, ValueError):
    """A task refused at enqueue (unknown name, payload its model rejects, bad option):
    nothing reached the table and the caller's transaction is untouched."""


class LeaseLost(OutboxkitError):
    """``ctx.transaction()`` found its task re-claimed by another worker (this attempt's lease
    ran out): the whole transaction was rolled back, so none of its writes landed."""
