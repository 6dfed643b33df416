"""The relay's partition maintenance (maintenance/side_task.py) bound to PostgreSQL's store.

Kept here because relay/engine.py starts it by this name.
"""

from __future__ import annotations

import asyncio

from outboxkit.backends.postgres.partitions import PartitionChore
from outboxkit.maintenance.side_task import partition_side_task


async def partition_maintenance(dsn: str, table: str, stopping: asyncio.Event) -> None:
    """Maintain ``table``'s partitions until ``stopping`` is set; return at once if plain."""
    await partition_side_task(PartitionChore(dsn, table), stopping)
