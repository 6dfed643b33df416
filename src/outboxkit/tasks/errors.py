"""Task mode's exceptions (defined in outboxkit.errors, with every other one)."""

from __future__ import annotations

from outboxkit.errors import InvalidTaskError, LeaseLost, TaskNotFound

__all__ = ["InvalidTaskError", "LeaseLost", "TaskNotFound"]
