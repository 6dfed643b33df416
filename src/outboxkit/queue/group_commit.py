"""Settles grouped while one runs: one statement or transaction (one commit) for many.

A worker settles each task on its own as it finishes (split claims); on a database whose
commit costs a log flush (MariaDB has no per-transaction ``synchronous_commit = off``) one
transaction per task caps a worker at one task per flush. While a group is being written,
the settles that arrive wait and go together in the next: the flushes per task fall as the
rate rises, and an idle worker's one settle goes at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from outboxkit.queue.store import StoreError, StoreUnavailable

__all__ = ["GroupCommit"]

K = TypeVar("K")


class GroupCommit(Generic[K]):
    """``await add(item)``: the ids ``write(items)`` changed, for the group ``item`` went in."""

    def __init__(self, write: Callable[[list[K]], Awaitable[set[int]]]) -> None:
        self._write = write
        self._waiting: list[tuple[K, asyncio.Future[set[int]]]] = []
        self._writing = False

    async def add(self, item: K) -> set[int]:
        done: asyncio.Future[set[int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, done))
        if not self._writing:
            self._writing = True
            group: list[tuple[K, asyncio.Future[set[int]]]] = []
            try:
                while self._waiting:
                    group, self._waiting = self._waiting, []
                    try:
                        changed = await self._write([i for i, _f in group])
                    except StoreError as exc:
                        for _i, waiter in group:
                            if not waiter.done():
                                waiter.set_exception(exc)
                        continue
                    for _i, waiter in group:
                        if not waiter.done():
                            waiter.set_result(changed)
            finally:
                self._writing = False
                # Cancelled mid-write (a forced shutdown): the others settle again later.
                interrupted = StoreUnavailable("the grouped settle was interrupted")
                for _i, waiter in [*group, *self._waiting]:
                    if not waiter.done():
                        waiter.set_exception(interrupted)
                self._waiting = []
        return await done
