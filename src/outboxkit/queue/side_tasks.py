"""The claim loop's side tasks under supervision (a LISTEN, lease heartbeats of ordered
mode, time-partition maintenance...): the first to fail stops the loop with its error, and
at the end each is cancelled and its error kept (queue/loop.py's ``run``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def watch_side_tasks(
    side_tasks: list[asyncio.Task[None]], fail: Callable[[str, BaseException], None]
) -> None:
    """Wait for a side task to end; one that failed stops the loop with its error."""
    pending = set(side_tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if not task.cancelled() and (exc := task.exception()) is not None:
                fail(task.get_name(), exc)
                return


async def cancel_and_capture_errors(
    tasks: list[asyncio.Task[None]],
) -> list[tuple[asyncio.Task[None], Exception]]:
    """Cancel ``tasks``, wait for them all, and return the errors they ended with."""
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return [
        (task, result)
        for task, result in zip(tasks, results, strict=True)
        if isinstance(result, Exception)
    ]
