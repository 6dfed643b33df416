"""A fleet's metrics: every database's relay (or task worker) metrics in one scrape, each
series labelled with its ``database`` (the name from the DSN file), and /readyz over all
of them.

Each database keeps its own :class:`RelayMetrics` or :class:`TaskMetrics` (its own
registry, its table gauges, its topic or task-name labels bounded as a single relay's or
worker's are); this registry collects them at scrape time and adds the label, so the series
of a database removed from the file leave with it. The process metrics are the fleet's,
once. The number of series is the databases' times a single relay's (worker's): a database
is a label value like a topic, listed by the operator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from outboxkit.fleet.supervisor import current_database
from outboxkit.ops.task_metrics import TaskMetrics

if TYPE_CHECKING:
    from outboxkit.fleet.supervisor import Fleet
    from outboxkit.ops.http import Scraped

#: The label every series of a database's relay gets.
DATABASE_LABEL = "database"
#: Databases whose task tables one scrape of a worker fleet reads at once.
_GAUGE_READERS = 16


class FleetMetrics:
    """The metrics of a fleet: ``add(name, metrics)`` per database, ``remove(name)`` when
    it leaves; ``registry`` is what /metrics renders, after :meth:`refresh`."""

    def __init__(self, *, process_metrics: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.databases: dict[str, Scraped] = {}
        #: Databases whose figures the last :meth:`refresh` could not read (reported down).
        self.unread: set[str] = set()
        self.fleet: Fleet | None = None  # set by attach(): the databases' states
        self.registry.register(_Databases(self))
        if process_metrics:
            ProcessCollector(registry=self.registry)

    def attach(self, fleet: Fleet) -> None:
        """Report the fleet's members (up or down) and their readiness."""
        self.fleet = fleet

    def add(self, name: str, metrics: Scraped) -> None:
        self.databases[name] = metrics

    async def refresh(self) -> None:
        """Read what a scrape reads at scrape time (nothing: a relay's gauges are kept)."""

    def close(self) -> None:
        """Let go of what :meth:`refresh` holds (the fleet has stopped)."""

    def remove(self, name: str, metrics: Scraped) -> None:
        """Drop ``name``'s series, unless a newer relay of that name replaced them."""
        if self.databases.get(name) is metrics:
            del self.databases[name]

    def not_ready_reason(self) -> str | None:
        """None when every listed database is relayed and ready; otherwise which are not."""
        problems: list[str] = []
        members = self.fleet.members if self.fleet is not None else {}
        unreachable = self.fleet.unreachable if self.fleet is not None else {}
        down = f"not {self.fleet.words.done if self.fleet else 'relayed'}"
        for name in sorted(set(unreachable) - set(members)):
            problems.append(f"{name}: {down} (unreachable or refused; see the log)")
        for name in sorted(members):
            member = members[name]
            if member.state == "down":
                problems.append(f"{name}: {down} (unreachable or refused; see the log)")
                continue
            metrics = self.databases.get(name)
            reason = metrics.not_ready_reason() if metrics is not None else None
            if member.state == "starting":
                reason = "starting"
            if reason is not None:
                problems.append(f"{name}: {reason}")
        if not problems:
            return None
        total = len(set(members) | set(unreachable))
        return f"{len(problems)} of {total} database(s) not ready: " + "; ".join(problems)


class _Databases(Collector):
    """Every database's families, merged by name, each sample labelled with its database."""

    def __init__(self, fleet: FleetMetrics) -> None:
        self.fleet = fleet

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for name, metrics in sorted(self.fleet.databases.items()):
            for family in metrics.registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    into.add_sample(
                        sample.name,
                        {**sample.labels, DATABASE_LABEL: name},
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
        yield from merged.values()
        fleet = self.fleet.fleet
        members = fleet.members if fleet is not None else {}
        done = fleet.words.done if fleet is not None else "relayed"
        up = GaugeMetricFamily(
            "outboxkit_fleet_database_up",
            f"1 while the database of this DSN-file line is {done}; 0 while it cannot be"
            " reached or refuses the login (retried with backoff; the log says why once),"
            " or (workers) its task table did not answer this scrape in time.",
            labels=[DATABASE_LABEL],
        )
        unreachable = fleet.unreachable if fleet is not None else {}
        unread = self.fleet.unread
        for name in sorted(set(members) | set(unreachable)):
            member = members.get(name)
            down = member is None or member.state == "down" or name in unread
            up.add_metric([name], 0 if down else 1)
        yield up


class WorkerFleetMetrics(FleetMetrics):
    """A task-worker fleet's metrics: each database's :class:`TaskMetrics`, whose table
    gauges every scrape reads from every database at once, each read time-boxed
    (``GAUGE_TIMEOUT``): a database that does not answer in time is served without its
    gauges and reported down (``outboxkit_fleet_database_up`` 0), never holding the scrape."""

    def __init__(self, *, process_metrics: bool = True) -> None:
        super().__init__(process_metrics=process_metrics)
        # Its own threads: a read hung on a database holds one of them, not the loop's.
        self._readers: ThreadPoolExecutor | None = None

    async def refresh(self) -> None:
        members = self.fleet.members if self.fleet is not None else {}
        tables: dict[str, TaskMetrics] = {}
        for name, metrics in self.databases.items():
            if not isinstance(metrics, TaskMetrics):
                continue
            member = members.get(name)
            if member is None or member.state == "running":
                tables[name] = metrics
            else:  # (down or starting: reported so, and a wrong password not tried again)
                metrics.forget_gauges()
        if not tables:
            self.unread = set()
            return
        if self._readers is None:
            self._readers = ThreadPoolExecutor(_GAUGE_READERS, "outboxkit-gauges")
        readers = self._readers

        async def read(name: str, metrics: TaskMetrics) -> bool:
            current_database.set(name)  # (its log line names the database)
            return await metrics.refresh(readers)

        names = list(tables)
        read_ok = await asyncio.gather(*(read(n, tables[n]) for n in names))
        self.unread = {n for n, ok in zip(names, read_ok, strict=True) if not ok}

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)
            self._readers = None
