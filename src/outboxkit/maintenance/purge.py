"""Deleting old rows in small batches: published outbox rows (``outboxkit purge``) and inbox
records (``outboxkit inbox purge``).

Each batch is its own short transaction, so purging years of history never holds a long
lock or builds one huge vacuum debt; ``pause`` leaves the database room between batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def in_batches(
    delete_batch: Callable[[], int],
    *,
    batch_size: int,
    pause: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Run ``delete_batch`` (deletes at most ``batch_size`` rows, returns how many) until a
    batch comes back short; returns the total."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    total = 0
    while True:
        deleted = delete_batch()
        total += deleted
        if progress is not None:
            progress(deleted)
        if deleted < batch_size:
            return total
        if pause:
            time.sleep(pause)
