"""A fleet's metrics: every database's relay metrics in one scrape, each series labelled
with its ``database`` (the name from the DSN file), and /readyz over all of them.

Each database keeps its own :class:`RelayMetrics` (its own registry, its table gauges, its
topic labels bounded as a single relay's are); this registry collects them at scrape time
and adds the label, so the series of a database removed from the file leave with it. The
process metrics are the fleet's, once. The number of series is the databases' times a
single relay's: a database is a label value like a topic, listed by the operator.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from outboxkit.ops.metrics import RelayMetrics

if TYPE_CHECKING:
    from outboxkit.fleet.supervisor import Fleet

#: The label every series of a database's relay gets.
DATABASE_LABEL = "database"


class FleetMetrics:
    """The metrics of a fleet: ``add(name, metrics)`` per database, ``remove(name)`` when
    it leaves; ``registry`` is what /metrics renders."""

    def __init__(self, *, process_metrics: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.databases: dict[str, RelayMetrics] = {}
        self.fleet: Fleet | None = None  # set by attach(): the databases' states
        self.registry.register(_Databases(self))
        if process_metrics:
            ProcessCollector(registry=self.registry)

    def attach(self, fleet: Fleet) -> None:
        """Report the fleet's members (up or down) and their readiness."""
        self.fleet = fleet

    def add(self, name: str, metrics: RelayMetrics) -> None:
        self.databases[name] = metrics

    def remove(self, name: str, metrics: RelayMetrics) -> None:
        """Drop ``name``'s series, unless a newer relay of that name replaced them."""
        if self.databases.get(name) is metrics:
            del self.databases[name]

    def not_ready_reason(self) -> str | None:
        """None when every listed database is relayed and ready; otherwise which are not."""
        problems: list[str] = []
        members = self.fleet.members if self.fleet is not None else {}
        unreachable = self.fleet.unreachable if self.fleet is not None else {}
        for name in sorted(set(unreachable) - set(members)):
            problems.append(f"{name}: not relayed (unreachable or refused; see the log)")
        for name in sorted(members):
            member = members[name]
            if member.state == "down":
                problems.append(f"{name}: not relayed (unreachable or refused; see the log)")
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
        members = self.fleet.fleet.members if self.fleet.fleet is not None else {}
        up = GaugeMetricFamily(
            "outboxkit_fleet_database_up",
            "1 while the database of this DSN-file line is relayed; 0 while it cannot be"
            " reached or refuses the login (retried with backoff; the log says why once).",
            labels=[DATABASE_LABEL],
        )
        unreachable = self.fleet.fleet.unreachable if self.fleet.fleet is not None else {}
        for name in sorted(set(members) | set(unreachable)):
            member = members.get(name)
            up.add_metric([name], 0 if member is None or member.state == "down" else 1)
        yield up
