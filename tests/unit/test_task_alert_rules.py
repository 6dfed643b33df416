"""The task alert rules only use metrics and labels a worker exports (ops/task_metrics.py)."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import yaml

from outboxkit.ops.task_metrics import TaskMetrics
from outboxkit.queue.tasks import ClaimedTask

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "outboxkit-tasks-alerts.yml"
_METRIC = re.compile(r"\boutboxkit_[a-z0-9_]+")
_LABELS = re.compile(r"\b(?:by)\s*\(([^)]*)\)|\{([a-z_]+)=")


def exported() -> dict[str, set[str]]:
    metrics = TaskMetrics("postgresql://unused", "outboxkit_tasks")
    task = ClaimedTask(1, "report", "default", None, 1, None, None, 0, dt.datetime.now(dt.UTC))
    metrics.ran([task], 0.01)
    metrics.settled([task], [task], [task])
    metrics.gauges.rows = [("report", 1, 2, 3, 4, 5.0)]
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_every_task_alert_uses_exported_metrics_and_labels() -> None:
    names = exported()
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert len(rules) == 4
    for rule in rules:
        expr = rule["expr"]
        used = set(_METRIC.findall(expr))
        assert used and used <= set(names), (rule["alert"], used - set(names))
        labels = {x.strip() for m in _LABELS.finditer(expr) for g in m.groups() if g
                  for x in g.split(",")}  # fmt: skip
        for metric in used:
            assert labels <= names[metric] | {"le"}, (rule["alert"], metric, labels)
