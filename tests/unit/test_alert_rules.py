"""The shipped alert rules and Grafana dashboard only use metrics and labels the relay exports."""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from outboxkit.ops.metrics import RelayMetrics, TableSnapshot
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.relay.status import CdcStatus, RelayStatus

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "outboxkit-alerts.yml"
GRAFANA = ROOT / "deploy" / "grafana" / "outboxkit.json"
_METRIC = re.compile(r"\boutboxkit_[a-z0-9_]+")
_GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"\{([^}]*)\}")
# Labels Prometheus adds when it scrapes (job, instance), and histogram buckets.
_SCRAPE_LABELS = {"job", "instance", "le"}


def exported() -> dict[str, set[str]]:
    """Sample names (with their labels) a relay exports after publishing and failing."""
    metrics = RelayMetrics("postgresql://unused", process_metrics=False)
    message = OutboundMessage(
        uuid.uuid4(), "orders", "k", "x", None, None, b"{}", {}, dt.datetime.now(dt.UTC)
    )
    metrics.claimed(3, 0.002)
    metrics.processed([message] * 3, [PublishResult.success()] * 3, 0.01)
    retry = PublishResult.retry("broker down", "ConnectionError")
    metrics.settled([message], [(message, retry)], [(message, PublishResult.permanent("big"))])
    metrics.snapshot = TableSnapshot(
        backlog={"orders": 1},
        in_flight={"orders": 0},
        failed={"orders": 1},
        oldest_pending_age={"orders": 2.0},
        read_at=1.0,
    )
    # A WAL relay (--source cdc): its stream's gauges and its slot's, as the server reports it.
    cdc = CdcStatus(slot="s", streaming=True, standby=False, confirmed_lsn=1, lag_seconds=0.0)
    metrics.status = lambda: RelayStatus(cdc=cdc)
    metrics.slot_lag(4096, wal_status="reserved")
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def check_expression(expr: str, names: dict[str, set[str]]) -> None:
    used = set(_METRIC.findall(expr))
    assert used, f"expression uses no outboxkit metric: {expr}"
    unknown = used - set(names)
    assert not unknown, f"not exported by the relay: {sorted(unknown)} in {expr}"
    available = set().union(*(names[n] for n in used)) | _SCRAPE_LABELS
    for group in _GROUPING.findall(expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            assert label in available, f"label {label!r} not on {sorted(used)}: {expr}"
    for selector in _SELECTOR.findall(expr):
        for matcher in filter(None, (x.strip() for x in selector.split(","))):
            label = re.split(r"[=!~]", matcher, maxsplit=1)[0].strip()
            assert label in available, f"label {label!r} not on {sorted(used)}: {expr}"
    assert expr.count("(") == expr.count(")"), f"unbalanced parentheses: {expr}"


def test_exported_names_include_every_metric_the_issue_asks_for() -> None:
    names = exported()
    for required in (
        "outboxkit_events_published_total",
        "outboxkit_publish_failures_total",
        "outboxkit_events_retried_total",
        "outboxkit_events_dead_lettered_total",
        "outboxkit_publish_latency_seconds_bucket",
        "outboxkit_broker_round_trip_seconds_bucket",
        "outboxkit_claim_batch_size_bucket",
        "outboxkit_claim_duration_seconds_bucket",
        "outboxkit_backlog",
        "outboxkit_in_flight",
        "outboxkit_failed",
        "outboxkit_oldest_pending_age_seconds",
        "outboxkit_lease_lost_total",
        "outboxkit_db_reconnects_total",
    ):
        assert required in names


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_alert_rules_file_has_the_alerts_an_outbox_needs() -> None:
    rules = {r["alert"]: r for r in _rules()}
    for name in (
        "OutboxBacklogGrowing",
        "OutboxPublishErrorRate",
        "OutboxPublishLatencyHigh",
        "OutboxRelayStuck",
        "OutboxOldestPendingTooOld",
        "OutboxDeadLetters",
    ):
        assert name in rules
    assert rules["OutboxBacklogGrowing"]["for"] == "5m"
    assert rules["OutboxPublishErrorRate"]["for"] == "2m"
    assert "0.05" in rules["OutboxPublishErrorRate"]["expr"]
    assert "0.99" in rules["OutboxPublishLatencyHigh"]["expr"]
    assert rules["OutboxPublishLatencyHigh"]["for"] == "5m"
    assert "[10m]" in rules["OutboxRelayStuck"]["expr"]


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_every_alert_is_well_formed_and_uses_exported_metrics(rule: dict[str, Any]) -> None:
    assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    if "for" in rule:
        assert re.fullmatch(r"\d+[smh]", rule["for"])
    check_expression(rule["expr"], exported())


def test_grafana_dashboard_queries_use_exported_metrics() -> None:
    board = json.loads(GRAFANA.read_text())
    names = exported()
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    for expr in exprs:
        check_expression(expr.replace('topic=~"$topic"', 'topic=~".*"'), names)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    used = {m for e in exprs for m in _METRIC.findall(e)}
    for gauge in ("outboxkit_backlog", "outboxkit_failed", "outboxkit_oldest_pending_age_seconds"):
        assert gauge in used
