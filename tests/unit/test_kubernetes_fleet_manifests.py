"""deploy/kubernetes/fleet refers only to what ``outboxkit relay --dsn-file`` has.

As tests/unit/test_kubernetes_manifests.py does for the single relay: the manifests are
parsed, their structure checked, and every flag, path, Secret key and metric they name is
looked up in the relay itself (the click command, the metrics it exports).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from outboxkit.ops.cli.relay import relay
from outboxkit.ops.fleet_metrics import DATABASE_LABEL
from tests.unit.test_alert_rules import check_expression, exported
from tests.unit.test_kubernetes_manifests import SCRAPE_LABELS

FLEET = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "fleet"
LABELS = {"app.kubernetes.io/name": "outboxkit", "app.kubernetes.io/component": "fleet"}


def _kustomization() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((FLEET / "kustomization.yaml").read_text())
    return doc


def _resources() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for name in _kustomization()["resources"]:
        for doc in yaml.safe_load_all((FLEET / name).read_text()):
            if doc is not None:
                assert doc["kind"] not in found, f"{doc['kind']} twice"
                found[doc["kind"]] = doc
    return found


def _pod() -> dict[str, Any]:
    spec: dict[str, Any] = _resources()["Deployment"]["spec"]["template"]["spec"]
    return spec


def test_the_kustomization_lists_every_manifest() -> None:
    listed = _kustomization()["resources"]
    assert sorted(listed) == sorted(
        p.name for p in FLEET.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    assert _resources().keys() == {
        "Deployment",
        "PodDisruptionBudget",
        "PodMonitor",
        "ScaledObject",
    }
    for kind, doc in _resources().items():
        assert LABELS.items() <= doc["metadata"]["labels"].items(), kind
        selector = doc["spec"].get("selector", {}).get("matchLabels")
        if selector is not None:
            assert selector == LABELS, kind


def test_the_arguments_are_relay_options_reading_the_file_from_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (container,) = _pod()["containers"]
    monkeypatch.setenv("OUTBOXKIT_BROKER", "nats://nats:4222")
    monkeypatch.delenv("OUTBOXKIT_DSN", raising=False)
    params = relay.make_context("relay", list(container["args"])).params
    assert params["dsn"] is None and params["fleet_lease"] and params["metrics_port"] == 9464
    path = Path(params["dsn_file"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    assert "subPath" not in mount, "a subPath mount never sees the Secret's updates"
    (volume,) = [v for v in _pod()["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    assert {"key": "databases", "path": path.name} in secret["items"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["OUTBOXKIT_BROKER"] == {"name": secret["secretName"], "key": "broker"}
    comment = (FLEET / "kustomization.yaml").read_text()
    assert f"secret generic {secret['secretName']}" in comment
    assert "--from-file=databases=" in comment and "--from-literal=broker=" in comment
    grace = _pod()["terminationGracePeriodSeconds"]
    assert grace > params["shutdown_timeout"]


def test_keda_scales_on_the_total_backlog_of_every_database() -> None:
    spec = _resources()["ScaledObject"]["spec"]
    assert spec["scaleTargetRef"]["name"] == _resources()["Deployment"]["metadata"]["name"]
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    query = trigger["metadata"]["query"]
    scrape = {n: labels | SCRAPE_LABELS | {DATABASE_LABEL} for n, labels in exported().items()}
    check_expression(query, scrape)
    assert "max by (database, topic) (outboxkit_backlog" in query
    monitor = _resources()["PodMonitor"]["metadata"]["name"]
    assert f'job="{_kustomization()["namespace"]}/{monitor}"' in query  # (a PodMonitor's job)


def test_builtin_kinds_validate_against_the_kubernetes_schemas() -> None:
    try:
        import kubernetes_validate  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        pytest.skip("kubernetes-validate is not installed")
    for kind in ("Deployment", "PodDisruptionBudget"):
        doc = _resources()[kind]
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
