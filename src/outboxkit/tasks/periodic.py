"""The worker's periodic side task: every tick, insert each schedule's due slots with their task.

Every worker runs it; the schedules table's primary key lets one insert per slot win
(backends/postgres/tasks_sql.py ``ENQUEUE_PERIODIC``), so there is no leader to lose or to double.
The clock is the database's. Missed slots (no worker ran, or the database was unreachable) are
caught up by each schedule's ``catch_up`` policy: the last one, all of them, or none."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence

from outboxkit._backoff import Backoff
from outboxkit._text import first_line
from outboxkit.queue.store import StoreError
from outboxkit.queue.tasks import Schedules
from outboxkit.tasks.schedule import MAX_CATCH_UP, Periodic

log = logging.getLogger("outboxkit.worker")

#: How often a worker looks for due slots (a second: a six-field cron fires per second).
TICK = 1.0
#: Each schedule's slots are kept a day (its newest always), pruned at start and hourly.
SLOTS_KEPT = 86_400.0
PRUNE_EVERY = 3_600.0
PRUNE_BATCH = 5_000  # slots a statement deletes; a full one is followed by another


async def run_periodic(
    schedules: Schedules,
    periodic: Sequence[Periodic],
    payloads: dict[str, str],
    stopping: asyncio.Event,
    wake: Callable[[], None],
    tick: float = TICK,
) -> None:
    """Insert due slots until ``stopping``; database errors are logged and retried."""
    since: dict[str, dt.datetime] = {}
    backoff = Backoff(base=0.5, cap=10.0)
    pruned_at = -PRUNE_EVERY  # at start, then every PRUNE_EVERY seconds
    while not stopping.is_set():
        try:
            if time.monotonic() - pruned_at >= PRUNE_EVERY:
                while (
                    await schedules.prune(SLOTS_KEPT, PRUNE_BATCH) >= PRUNE_BATCH
                    and not stopping.is_set()
                ):
                    pass
                pruned_at = time.monotonic()
            for p in periodic:
                if p.schedule not in since:
                    last, now = await schedules.last_slot(p.schedule)
                    # Never ran: nothing was missed yet. Otherwise the policy decides below.
                    since[p.schedule] = now if last is None or p.catch_up == "none" else last
                now = await schedules.now()
                due = list(p.cron.slots(since[p.schedule], now))
                if p.catch_up == "last":
                    due = due[-1:]
                elif p.catch_up == "all":
                    due = due[-MAX_CATCH_UP:]
                else:
                    due = [s for s in due if now - s <= dt.timedelta(seconds=tick * 3)]
                for slot in due:
                    task_id = await schedules.enqueue(
                        p.schedule, slot, p.task_name, p.queue, payloads[p.schedule], p.priority
                    )
                    if task_id is not None:
                        log.info("periodic %s: enqueued task %d for %s", p.schedule, task_id, slot)
                        wake()
                since[p.schedule] = now
            backoff.reset()
            delay = tick
        except StoreError as exc:  # (each backend's Schedules raises only these)
            delay = backoff.next_delay()
            log.warning("periodic tasks: %s; retrying in %.1fs", first_line(exc), delay)
            await schedules.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=delay)
    await schedules.close()
