"""deploy/kubernetes and deploy/Dockerfile refer only to what the relay has.

No cluster and no image build: the manifests are parsed, their structure checked (kinds,
API versions, selectors against labels, probes), and every flag, environment variable,
port, path and metric they name is looked up in the relay itself (the click command, the
aiohttp routes, the metrics registry). Where `kubernetes-validate` is installed, the
built-in kinds are also validated against the Kubernetes API schemas.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from outboxkit.ops.cli import main
from outboxkit.ops.cli.relay import relay
from outboxkit.ops.http import metrics_app
from outboxkit.ops.metrics import DEFAULT_GAUGE_ROW_CAP, RelayMetrics
from tests.unit.test_alert_rules import check_expression, exported

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
OPERATIONS = ROOT / "docs" / "operations.md"
LABELS = {"app.kubernetes.io/name": "outboxkit", "app.kubernetes.io/component": "relay"}
# Labels the Prometheus operator puts on every scraped series (besides the relay's own).
SCRAPE_LABELS = {"namespace", "job", "pod", "service", "endpoint", "container"}
# The Kubernetes versions the built-in kinds are validated against: an old supported one
# and the newest the validator knows.
K8S_VERSIONS = ("1.27.0", "latest")


def _kustomization() -> dict[str, Any]:
    doc = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _resources() -> dict[str, dict[str, Any]]:
    """The kustomization's resources by kind (each kind once in this deployment)."""
    found: dict[str, dict[str, Any]] = {}
    for name in _kustomization()["resources"]:
        for doc in _documents(K8S / name):
            assert doc["kind"] not in found, f"{doc['kind']} twice"
            found[doc["kind"]] = doc
    return found


def _container() -> dict[str, Any]:
    containers = _resources()["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _relay_env() -> set[str]:
    """The environment variables `outboxkit relay` reads."""
    names: set[str] = set()
    for param in relay.params:
        envvar = getattr(param, "envvar", None)
        if isinstance(envvar, str):
            names.add(envvar)
        elif envvar:
            names.update(envvar)
    return names


def _generated_config() -> dict[str, dict[str, str]]:
    """configMapGenerator's ConfigMaps: name -> data."""
    maps: dict[str, dict[str, str]] = {}
    for gen in _kustomization().get("configMapGenerator", []):
        data = dict(item.split("=", 1) for item in gen.get("literals", []))
        maps[gen["name"]] = data
    return maps


def _parsed_args(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The container's arguments as `outboxkit relay` parses them (with the pod's env)."""
    for name, value in _generated_config()["outboxkit-relay"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OUTBOXKIT_DSN", "postgresql://relay@db/shop")
    monkeypatch.setenv("OUTBOXKIT_BROKER", "nats://nats:4222")
    ctx = relay.make_context("relay", list(_container()["args"]))
    return ctx.params


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    wanted = selector.get("matchLabels", selector)
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def test_kustomization_lists_every_manifest_and_each_file_exists() -> None:
    listed = _kustomization()["resources"]
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization.yaml lists {name}, which is missing"
    comment = (K8S / "kustomization.yaml").read_text()
    for path in K8S.glob("*.yaml"):
        if path.name == "kustomization.yaml":
            continue
        # podmonitor.yaml is the documented alternative to the Service + ServiceMonitor pair
        assert path.name in listed or path.name in comment, f"{path.name} is in no kustomization"
    assert _resources().keys() == {
        "Namespace",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
        "ScaledObject",
    }


def test_every_manifest_has_a_known_kind_and_api_version() -> None:
    api = {
        "Namespace": "v1",
        "Deployment": "apps/v1",
        "PodDisruptionBudget": "policy/v1",
        "Service": "v1",
        "ServiceMonitor": "monitoring.coreos.com/v1",
        "PodMonitor": "monitoring.coreos.com/v1",
        "PrometheusRule": "monitoring.coreos.com/v1",
        "ScaledObject": "keda.sh/v1alpha1",
    }
    for path in K8S.glob("*.yaml"):
        if path.name == "kustomization.yaml":
            continue
        for doc in _documents(path):
            assert api.get(doc["kind"]) == doc["apiVersion"], f"{path.name}: {doc['kind']}"
            assert doc["metadata"]["name"], path.name


def test_selectors_match_the_relay_pods_labels() -> None:
    res = _resources()
    deployment = res["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert LABELS.items() <= pod_labels.items()
    assert _matches(deployment["spec"]["selector"], pod_labels)
    assert _matches(res["PodDisruptionBudget"]["spec"]["selector"], pod_labels)
    assert _matches(res["Service"]["spec"]["selector"], pod_labels)
    assert _matches(res["ServiceMonitor"]["spec"]["selector"], res["Service"]["metadata"]["labels"])
    for constraint in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]:
        assert _matches(constraint["labelSelector"], pod_labels)
    pod_monitor = _documents(K8S / "podmonitor.yaml")[0]
    assert _matches(pod_monitor["spec"]["selector"], pod_labels)
    scaled = res["ScaledObject"]["spec"]["scaleTargetRef"]
    assert (scaled["kind"], scaled["name"]) == ("Deployment", deployment["metadata"]["name"])


def test_the_container_arguments_are_relay_options(monkeypatch: pytest.MonkeyPatch) -> None:
    # make_context raises on an unknown option or a bad value, as `outboxkit relay` would
    params = _parsed_args(monkeypatch)
    assert params["metrics_host"] == "0.0.0.0", "the kubelet probes the pod's address"
    assert params["metrics_port"] == 9464
    assert not params["with_dashboard"], "the dashboard would serve payloads to the cluster"
    flags = {opt for p in relay.params for opt in p.opts}
    for arg in _container()["args"]:
        if arg.startswith("--"):
            assert arg.split("=", 1)[0] in flags


def test_the_environment_is_what_the_relay_reads() -> None:
    container = _container()
    reads = _relay_env()
    names = {e["name"] for e in container["env"]}
    # service links would add <SERVICE>_PORT variables: outboxkit-metrics -> OUTBOXKIT_METRICS_PORT
    assert _resources()["Deployment"]["spec"]["template"]["spec"]["enableServiceLinks"] is False
    assert {"OUTBOXKIT_DSN", "OUTBOXKIT_BROKER"} <= names
    assert names <= reads, f"the relay reads none of {sorted(names - reads)}"
    maps = _generated_config()
    for source in container["envFrom"]:
        data = maps[source["configMapRef"]["name"]]
        assert set(data) <= reads, f"the relay reads none of {sorted(set(data) - reads)}"
    # the secrets come from a Secret, never as a value in the manifest
    for entry in container["env"]:
        if entry["name"] in {"OUTBOXKIT_DSN", "OUTBOXKIT_BROKER"}:
            assert "value" not in entry
            assert entry["valueFrom"]["secretKeyRef"]["name"] == "outboxkit-relay"


def test_the_secret_the_docs_create_is_the_one_the_deployment_reads() -> None:
    wanted = {
        (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in _container()["env"]
        if "valueFrom" in e
    }
    for path in (OPERATIONS, ROOT / "docs" / "kubernetes.md", K8S / "kustomization.yaml"):
        source = path.read_text()
        command = re.search(r"create secret generic (\S+)((?:[\s\\#]*--from-literal=\S+)+)", source)
        assert command is not None, f"no `kubectl create secret generic` snippet in {path.name}"
        keys = re.findall(r"--from-literal=([A-Za-z0-9_.-]+)=", command.group(2))
        assert {(command.group(1), k) for k in keys} == wanted, path.name


def test_ports_and_probe_paths_exist_in_the_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    params = _parsed_args(monkeypatch)
    container = _container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": params["metrics_port"]}
    app = metrics_app(RelayMetrics("postgresql://unused", process_metrics=False))
    routes = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    probes = {k: container[k]["httpGet"] for k in ("startupProbe", "livenessProbe")}
    probes["readinessProbe"] = container["readinessProbe"]["httpGet"]
    assert {k: p["path"] for k, p in probes.items()} == {
        "startupProbe": "/healthz",
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    for probe in probes.values():
        assert probe["path"] in routes
        assert probe["port"] in ports or probe["port"] in ports.values()
    service_ports = _resources()["Service"]["spec"]["ports"]
    assert [(p["name"], p["targetPort"]) for p in service_ports] == [("metrics", "metrics")]
    monitors = [_resources()["ServiceMonitor"]["spec"]["endpoints"]]
    monitors.append(_documents(K8S / "podmonitor.yaml")[0]["spec"]["podMetricsEndpoints"])
    for endpoints in monitors:
        for endpoint in endpoints:
            assert endpoint["port"] == "metrics"
            assert endpoint["path"] == "/metrics"
            assert endpoint["path"] in routes


def test_graceful_termination_outlasts_the_shutdown_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params = _parsed_args(monkeypatch)
    timeout = params["shutdown_timeout"]
    assert timeout is not None, "give --shutdown-timeout so the grace period can follow it"
    grace = _resources()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # after the timeout: hand back the unpublished rows and close the connections
    assert grace >= timeout + 10


def test_the_pod_runs_unprivileged_on_a_read_only_root() -> None:
    pod = _resources()["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == _dockerfile_uid()
    assert pod["automountServiceAccountToken"] is False
    context = _container()["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]


def test_resources_request_memory_and_cap_it() -> None:
    resources = _container()["resources"]

    def mib(quantity: str) -> float:
        number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()  # type: ignore[union-attr]
        return int(number) * (1024 if unit == "Gi" else 1)

    # measured: 67 MB at most draining a backlog (the comment in deployment.yaml)
    assert mib(resources["requests"]["memory"]) >= 67 * 1e6 / 2**20
    assert mib(resources["limits"]["memory"]) >= mib(resources["requests"]["memory"])
    assert resources["requests"]["cpu"]
    assert "cpu" not in resources["limits"]


def test_the_disruption_budget_lets_a_drain_through() -> None:
    spec = _resources()["PodDisruptionBudget"]["spec"]
    assert spec == spec | {"maxUnavailable": 1}
    assert "minAvailable" not in spec


def test_the_prometheus_rule_holds_the_shipped_alert_rules() -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "outboxkit-alerts.yml").read_text())
    assert _resources()["PrometheusRule"]["spec"]["groups"] == rules["groups"], (
        "prometheusrule.yaml's spec.groups must be deploy/prometheus/outboxkit-alerts.yml's groups"
    )


def _scaled_object() -> dict[str, Any]:
    spec: dict[str, Any] = _resources()["ScaledObject"]["spec"]
    return spec


def test_keda_scales_on_the_backlog_metric_the_relay_exports() -> None:
    spec = _scaled_object()
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert "outboxkit_backlog" in query
    names = exported()
    scrape = {n: labels | SCRAPE_LABELS for n, labels in names.items()}
    check_expression(query, scrape)
    # the same relabelling: job is the Service's name (a ServiceMonitor's default)
    assert f'job="{_resources()["Service"]["metadata"]["name"]}"' in query
    assert f'namespace="{_kustomization()["namespace"]}"' in query


def test_keda_never_scales_to_zero_and_can_reach_its_maximum() -> None:
    spec = _scaled_object()
    # zero relays export no backlog: nothing would scale them up again
    assert spec["minReplicaCount"] >= 1
    assert spec["maxReplicaCount"] > spec["minReplicaCount"]
    threshold = float(spec["triggers"][0]["metadata"]["threshold"])
    assert threshold > 0
    # the backlog gauge saturates at the gauges' row cap: replicas past it are unreachable
    assert math.ceil(DEFAULT_GAUGE_ROW_CAP / threshold) >= spec["maxReplicaCount"]
    deployment = _resources()["Deployment"]["spec"]
    assert spec["minReplicaCount"] <= deployment["replicas"] <= spec["maxReplicaCount"]


def _stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (instruction, argument), continuations joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, argument = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction.upper(), argument.strip()))
    return stages


def _dockerfile_uid() -> int:
    users = [arg for ins, arg in _stages()[-1] if ins == "USER"]
    assert users, "the final image must set USER"
    uid = users[-1].split(":", 1)[0]
    assert uid.isdigit(), "a numeric USER: runAsNonRoot cannot check a name"
    return int(uid)


def test_the_image_runs_as_a_non_root_user() -> None:
    assert _dockerfile_uid() != 0


def test_the_image_entrypoint_is_the_relay_command() -> None:
    final = _stages()[-1]
    (entrypoint,) = [json.loads(arg) for ins, arg in final if ins == "ENTRYPOINT"]
    script, command = entrypoint
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[script] == "outboxkit.ops.cli:main"
    assert isinstance(main, click.Group)
    assert main.commands[command] is relay
    (cmd,) = [json.loads(arg) for ins, arg in final if ins == "CMD"]
    assert relay.make_context("relay", [*cmd, "--dsn", "postgresql://x/y", "--broker", "nats://n"])
    exposed = [int(p) for ins, arg in final if ins == "EXPOSE" for p in arg.split()]
    assert exposed == [c["containerPort"] for c in _container()["ports"]]


def test_the_wheel_is_built_in_a_builder_stage_and_the_final_image_has_no_compiler() -> None:
    *builders, final = _stages()
    assert builders, "multi-stage: the wheel is built apart from the final image"
    assert any("pip wheel" in arg for ins, arg in builders[0] if ins == "RUN")
    assert not [arg for ins, arg in final if ins == "RUN" and re.search(r"\b(apt|pip)\b", arg)]
    base = final[0][1]
    assert base.split(":", 1)[1].endswith("-slim"), base
    copied = [shlex.split(arg) for ins, arg in final if ins == "COPY"]
    assert all(parts[0].startswith("--from=") for parts in copied), "only the built venv"
    compilers = re.compile(r"\b(gcc|g\+\+|clang|build-essential|cc)\b")
    assert not [arg for ins, arg in final if ins == "RUN" and compilers.search(arg)]


def test_builtin_kinds_validate_against_the_kubernetes_schemas() -> None:
    try:
        import kubernetes_validate  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (the dev extra has it)")
    builtin = {"Namespace", "Deployment", "PodDisruptionBudget", "Service"}
    checked = 0
    for version in K8S_VERSIONS:
        wanted = kubernetes_validate.latest_version() if version == "latest" else version
        for kind, doc in _resources().items():
            if kind in builtin:
                kubernetes_validate.validate(doc, wanted, strict=True)
                checked += 1
    assert checked == 2 * len(builtin)
