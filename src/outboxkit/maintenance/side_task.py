"""The relay's side task for a partitioned outbox: partitions ahead, expired ones dropped.

Every relay of a partitioned table runs it (a plain table ends it at once); the table's
maintenance lock (backends/postgres/partitions.py) lets one run at a time, the others skip. It runs
at start and every :data:`INTERVAL` seconds, with the settings ``migrate --partition-by`` stored. A
failed run (database down, a lock not obtained) is logged and retried at the next one: a missed run
costs nothing while partitions exist ahead (3 periods by default)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from outboxkit._text import first_line
from outboxkit.maintenance.partitions import MaintenanceReport

log = logging.getLogger("outboxkit.relay.time_partitions")

#: Seconds between two maintenance runs of one relay.
INTERVAL = 300.0
#: Seconds between two tries of the "is it partitioned?" check while the database is down.
CHECK_RETRY = 10.0
_T = TypeVar("_T")


class PartitionChore(Protocol):
    """One table's partition maintenance as the backend runs it (blocking calls)."""

    table: str
    #: What a run raises when it could not do its work (database down, ...): logged, retried.
    errors: tuple[type[Exception], ...]

    def is_partitioned(self) -> bool: ...

    def maintain(self) -> MaintenanceReport: ...


async def partition_side_task(chore: PartitionChore, stopping: asyncio.Event) -> None:
    """Maintain the table's partitions until ``stopping`` is set; return at once if plain.

    While the database cannot say whether the table is partitioned (down at start), the
    check is retried quietly: a plain table's relay says nothing about partitions.
    """
    partitioned: bool | None = None
    while not stopping.is_set():
        try:
            if partitioned is None:
                partitioned = await _in_thread(chore.is_partitioned)
                if not partitioned:
                    return
            report = await _in_thread(chore.maintain)
        except chore.errors as exc:
            if partitioned is None:
                log.debug("partition check deferred: %s", first_line(exc))
            else:
                log.warning(
                    "partition maintenance of %s failed (%s); retrying later",
                    chore.table,
                    first_line(exc),
                )
        else:
            report.log()
        wait = INTERVAL if partitioned else min(INTERVAL, CHECK_RETRY)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=wait)


async def _in_thread(fn: Callable[[], _T]) -> _T:
    """``fn`` in a thread; a cancelled relay still waits for it (its connection closes
    before the relay's run() returns; each lock it waits for is bounded by lock_timeout)."""
    future = asyncio.get_running_loop().run_in_executor(None, fn)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await future
        raise
