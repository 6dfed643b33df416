"""The replication stream read ahead into a bounded queue, taken by the relay in batches.

The stream (``cdc/stream.py``) is an async iterator that waits for the socket when there
is nothing to read; the relay wants "everything available now, up to N" to fill a batch
without waiting for one more event. A pump task reads ahead into a queue of ``capacity``
items and stops reading when it is full (the stream keeps its connection alive meanwhile),
so memory stays bounded whatever the size of a transaction, and the WAL is read and
decoded while the previous batch is being published.
"""

from __future__ import annotations

import asyncio
import contextlib

from outboxkit.cdc.stream import Item, ReplicationStream


class _End:
    """The pump's last item: the stream ended with ``error`` (None: closed)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class StreamReader:
    """One connection to the slot: ``open()``, ``take()`` batches, ``confirm()``, ``close()``."""

    def __init__(self, dsn: str, slot: str, publication: str, *, capacity: int = 8192) -> None:
        self.stream = ReplicationStream(dsn, slot, publication)
        self._queue: asyncio.Queue[Item | _End] = asyncio.Queue(maxsize=max(capacity, 1))
        self._pump: asyncio.Task[None] | None = None
        self._end: _End | None = None

    async def open(self) -> None:
        """Start streaming; raises ``SlotInUse`` while another process streams the slot."""
        await self.stream.open()
        self._pump = asyncio.create_task(self._read(), name="outboxkit-cdc:stream")

    async def _read(self) -> None:
        try:
            async for item in self.stream:
                await self._queue.put(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._queue.put(_End(exc))
            return
        await self._queue.put(_End(None))

    async def take(self, limit: int, *, wait: float) -> list[Item]:
        """Up to ``limit`` items: waits up to ``wait`` seconds for the first, then takes what
        is already read. Raises the stream's error once the items before it are taken."""
        if self._end is not None:
            self._raise_end()
        queue = self._queue
        items: list[Item] = []
        if queue.empty():
            with contextlib.suppress(TimeoutError):
                first = await asyncio.wait_for(queue.get(), wait)
                if isinstance(first, _End):
                    self._end = first
                    self._raise_end()
                else:
                    items.append(first)
        while len(items) < limit and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, _End):
                self._end = item  # raised on the next take, after these items are handled
                break
            items.append(item)
        return items

    def _raise_end(self) -> None:
        assert self._end is not None
        if self._end.error is not None:
            raise self._end.error
        from outboxkit.cdc.errors import ReplicationConnectionLost

        raise ReplicationConnectionLost("the replication stream ended")

    def confirm(self, lsn: int) -> None:
        """Tell the server everything before ``lsn`` is published (the slot moves there)."""
        self.stream.confirm(lsn)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(BaseException):
                await self._pump
            self._pump = None
        self.stream.close()
