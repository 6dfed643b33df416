"""The task worker's Prometheus metrics: outcomes and run time per task name (from the
worker's observer), queue depth, running, failed and the oldest queued age (read from the
table at each scrape). At most ``max_names`` task names get series of their own; the rest
are counted as ``(other)``, so the series stay bounded whatever names the table holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from outboxkit._redact import redact
from outboxkit.backends import backend_for
from outboxkit.ops._throttle import Throttled
from outboxkit.queue.tasks import DEFAULT_MAX_TASK_NAMES, OTHER_TASKS, ClaimedTask

_RUN_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1, 5, 30, 120, 600, 3600)


log = logging.getLogger("outboxkit.worker")
#: A scrape waits this long for the table's gauges, then serves the rest without them.
GAUGE_TIMEOUT = 2.0


#: What a scrape reads from the table: the per-name gauges and each queue's (queue, paused).
_Read = tuple[list[tuple[Any, ...]], list[tuple[str, bool]]]


class _TableGauges(Collector):
    """Read at scrape time (the scrape runs it in a thread)."""

    def __init__(self, dsn: str, table: str, max_names: int) -> None:
        self.dsn = dsn
        self.table = table
        self.max_names = max_names
        self.rows: list[tuple[Any, ...]] = []
        #: (queue, paused) of every queue with live tasks or a pause record.
        self.queues: list[tuple[str, bool]] = []

    def read(self) -> _Read:
        """The table's gauges and its queues' states (blocking: run in a thread)."""
        ops = backend_for(self.dsn).task_admin()
        rows = ops.task_gauges(self.dsn, self.table, max_names=self.max_names)
        return rows, [(q["queue"], q["paused"]) for q in ops.queue_states(self.dsn, self.table)]

    def collect(self) -> Iterable[Metric]:
        names = ("queued", "scheduled", "running", "failed")
        families = {
            n: GaugeMetricFamily(f"outboxkit_tasks_{n}", f"Tasks {n}, per task", labels=["task"])
            for n in names
        }
        age = GaugeMetricFamily(
            "outboxkit_tasks_oldest_queued_age_seconds",
            "Age of the oldest due pending task, per task name",
            labels=["task"],
        )
        for name, *counts, oldest in self.rows:
            for family, value in zip(names, counts, strict=True):
                families[family].add_metric([name], float(value))
            age.add_metric([name], float(oldest or 0.0))
        yield from families.values()
        yield age
        paused = GaugeMetricFamily(
            "outboxkit_task_queue_paused",
            "1 while a queue is paused (`outboxkit tasks pause`): no worker claims from it",
            labels=["queue"],
        )
        for queue, is_paused in self.queues:
            paused.add_metric([queue], 1.0 if is_paused else 0.0)
        yield paused


class TaskMetrics:
    """The worker's observer (``Worker(observer=...)``) and the registry it fills."""

    def __init__(self, dsn: str, table: str, *, max_names: int = DEFAULT_MAX_TASK_NAMES) -> None:
        if max_names < 0:
            raise ValueError("the number of task names with series cannot be negative")
        self.max_names = max_names
        # The first max_names names the worker sees keep their series; a handler's names
        # are few, but an unknown name in the table is counted (failed) too.
        self._labelled: set[str] = set()
        self.registry = CollectorRegistry()
        self.finished = Counter(
            "outboxkit_tasks_finished_total",
            "Task attempts finished, by task name and outcome (done, retried, failed)",
            ["task", "outcome"],
            registry=self.registry,
        )
        self.run_seconds = Histogram(
            "outboxkit_task_run_seconds",
            "Handler run time per claim, by task name",
            ["task"],
            buckets=_RUN_BUCKETS,
            registry=self.registry,
        )
        self.gauges = _TableGauges(dsn, table, max_names)
        self.registry.register(self.gauges)
        self._reading: asyncio.Future[_Read] | None = None
        self._gauge_errors = Throttled(log, 60.0)
        self._worker: Any = None

    def label(self, name: str) -> str:
        """``name`` if it has (or gets, while there is room) series of its own, else (other)."""
        if name not in self._labelled and len(self._labelled) < self.max_names:
            self._labelled.add(name)
        return name if name in self._labelled else OTHER_TASKS

    def ran(self, tasks: Sequence[ClaimedTask], seconds: float) -> None:
        for task in tasks:
            self.run_seconds.labels(self.label(task.task_name)).observe(seconds)

    def settled(
        self,
        done: Sequence[ClaimedTask],
        retried: Sequence[ClaimedTask],
        failed: Sequence[ClaimedTask],
    ) -> None:
        for outcome, tasks in (("done", done), ("retried", retried), ("failed", failed)):
            for task in tasks:
                self.finished.labels(self.label(task.task_name), outcome).inc()

    def attach(self, worker: Any) -> None:
        """Take /readyz's reason from ``worker`` (the :class:`Worker` this observes)."""
        self._worker = worker

    def not_ready_reason(self) -> str | None:
        """The attached worker's reason not to be ready (``/readyz``), or None."""
        return None if self._worker is None else self._worker.not_ready_reason()

    def forget_gauges(self) -> None:
        """Serve no table gauges until the next :meth:`refresh` (its database is down)."""
        self.gauges.rows, self.gauges.queues = [], []

    async def refresh(self, executor: Executor | None = None) -> bool:
        """Read the table's gauges (in ``executor``'s thread); whether they were read.

        The read is bounded (``GAUGE_TIMEOUT``) and never two at once: while the database
        is restarting or unreachable (a black hole kept a scrape 5 s and more, a restart
        answered 500) the counters and the histogram are served without the table's gauges.
        """
        gauges = self.gauges
        if self._reading is None or self._reading.done():
            loop = asyncio.get_running_loop()
            self._reading = loop.run_in_executor(executor, gauges.read)
            self._reading.add_done_callback(_retrieve)
        try:
            read = await asyncio.wait_for(asyncio.shield(self._reading), GAUGE_TIMEOUT)
            gauges.rows, gauges.queues = read
        except Exception as exc:  # (TimeoutError, a database error)
            self.forget_gauges()
            self._gauge_errors(
                logging.WARNING,
                "the task table's gauges could not be read (%s); /metrics serves the counters"
                " without them until the database answers",
                type(exc).__name__,
            )
            return False
        return True

    async def render(self) -> bytes:
        """Read the table's gauges (:meth:`refresh`), then render (off the event loop)."""
        await self.refresh()
        return await asyncio.to_thread(generate_latest, self.registry)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """A read that fails after its scrape gave up: its error was said there already."""
    if not future.cancelled():
        future.exception()


def task_metrics_app(
    metrics: TaskMetrics, not_ready: Callable[[], str | None] | None = None
) -> web.Application:
    """``/metrics``, ``/healthz`` and ``/readyz`` (``not_ready``'s reason: 503) of one worker."""

    async def scrape(_request: web.Request) -> web.Response:
        body = await metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_request: web.Request) -> web.Response:
        reason = not_ready() if not_ready is not None else None
        if reason is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {redact(reason)}\n")

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
