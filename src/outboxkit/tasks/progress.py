"""``ctx.progress(value)``: a running task's progress, written every so often, fenced.

A handler may report progress in a tight loop; a statement per call would cost more than
the work. So values are only kept here (the last one per task) and a worker writes what
it has at most every :data:`PROGRESS_INTERVAL` seconds, all tasks in one statement, each
fenced by its claim token (a zombie attempt's progress matches no row). The first value
after a quiet spell is written at once. Progress is best effort: a failed write is
dropped (the next value replaces it), never the task's failure.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
import threading
import uuid
from typing import Any

import orjson

from outboxkit.queue.store import StoreError
from outboxkit.queue.tasks import TaskStore

__all__ = ["MAX_PROGRESS_BYTES", "PROGRESS_INTERVAL", "ProgressWriter", "encode_progress"]

#: A worker writes reported progress at most this often (seconds).
PROGRESS_INTERVAL = 1.0
#: A progress value's JSON text may not be larger: it is a status line, not a result.
MAX_PROGRESS_BYTES = 4096

log = logging.getLogger("outboxkit.worker")


def encode_progress(value: Any) -> str:
    """A fraction from 0 to 1, or a small JSON object, as JSON text; else a clear error."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not 0 <= float(value) <= 1:
            raise ValueError(f"progress is a fraction from 0 to 1, got {value!r}")
        return orjson.dumps(float(value)).decode()
    if not isinstance(value, dict):
        raise TypeError(
            f"progress is a number from 0 to 1 or a dict (a small JSON object), got {value!r:.80}"
        )
    try:
        text = orjson.dumps(value).decode()
    except orjson.JSONEncodeError as exc:
        raise TypeError(f"progress must be JSON: {exc}") from None
    if len(text) > MAX_PROGRESS_BYTES or "\\u0000" in text:
        raise ValueError(
            f"progress is {len(text)} bytes of JSON (at most {MAX_PROGRESS_BYTES}, without NUL)"
        )
    return text


class ProgressWriter:
    """The worker's progress reports: kept per task, written together every so often."""

    def __init__(self, store: TaskStore, interval: float = PROGRESS_INTERVAL) -> None:
        self.store = store
        self.interval = interval
        #: The worker's event loop (set when it first runs tasks); reports from handler
        #: threads are handed to it.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, tuple[uuid.UUID, str]] = {}
        #: What the flush in progress writes (a settle racing it writes the value too).
        self._writing: dict[int, tuple[uuid.UUID, str]] = {}
        self._lock = threading.Lock()
        self._scheduled = False
        self._task: asyncio.Task[None] | None = None

    def report(self, task_id: int, token: uuid.UUID, value: Any) -> None:
        """Keep ``value`` as the task's progress (from any thread); checked now."""
        text = encode_progress(value)
        with self._lock:
            self._pending[task_id] = (token, text)
            if self._scheduled or self.loop is None:
                return
            self._scheduled = True
        loop = self.loop
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is loop:
            self._start()
        else:
            loop.call_soon_threadsafe(self._start)

    def take(self, task_id: int) -> str | None:
        """The task's last value not written yet (it goes with the task's completion)."""
        with self._lock:
            pending = self._pending.pop(task_id, None) or self._writing.get(task_id)
        return None if pending is None else pending[1]

    def _start(self) -> None:
        assert self.loop is not None
        self._task = self.loop.create_task(self._flush(), name="outboxkit-worker:progress")

    async def _flush(self) -> None:
        while True:
            with self._lock:
                batch, self._pending = self._pending, {}
                self._writing = batch
                if not batch:
                    self._scheduled = False
                    return
            try:
                await self.store.progress([(i, t, v) for i, (t, v) in batch.items()])
            except StoreError as exc:
                log.debug("progress of %d task(s) not written: %s", len(batch), exc)
            finally:
                with self._lock:
                    self._writing = {}
            await asyncio.sleep(self.interval)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
