"""deploy/kubernetes/deployment.yaml's container, run as a real `outboxkit relay` process.

The manifest's arguments and environment, against a real PostgreSQL and NATS JetStream:
the probes answer on the manifest's paths within its startup budget, /metrics serves
every metric the KEDA query reads, the relay writes no file (the pod's root filesystem is
read-only), and SIGTERM mid-backlog ends it with exit 0 well inside the grace period.
Only the address changes: a free loopback port instead of 0.0.0.0:9464 on this machine.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psycopg
import yaml

from outboxkit.testing import free_port, spawn_relay
from tests.support.relaying import count, make_events, write_events

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"


def _manifest() -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """The pod spec, its container and the generated ConfigMap's data."""
    deployment = yaml.safe_load((K8S / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    config = dict(item.split("=", 1) for item in generator["literals"])
    return pod, pod["containers"][0], config


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def _wait(what: str, timeout: float, check: Any, relay: Any, log: Path) -> float:
    started = time.monotonic()
    while not check():
        assert relay.poll() is None, f"relay exited: {log.read_text()[-3000:]}"
        assert time.monotonic() - started < timeout, f"no {what} in {timeout}s: {log.read_text()}"
        time.sleep(0.1)
    return time.monotonic() - started


def _files_open_for_writing(pid: int, allowed: set[str]) -> list[str]:
    """Regular files the process holds open for writing, besides `allowed`."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            flags = int(Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split()[3], 8)
            regular = stat.S_ISREG(os.stat(f"/proc/{pid}/fd/{fd}").st_mode)
        except (FileNotFoundError, ProcessLookupError):
            continue  # closed meanwhile
        if regular and flags & os.O_ACCMODE != os.O_RDONLY and target not in allowed:
            found.append(target)
    return found


def test_the_deployments_container_runs_probes_answer_and_sigterm_exits_in_grace(
    db_dsn: str, nats_server: Any, tmp_path: Path
) -> None:
    pod, container, config = _manifest()
    port = free_port()
    args = []
    for arg in container["args"]:
        if arg.startswith("--metrics-port="):
            arg = f"--metrics-port={port}"
        elif arg.startswith("--metrics-host="):
            arg = "--metrics-host=127.0.0.1"  # never 0.0.0.0 on a shared machine
        args.append(arg)
    assert f"--metrics-port={port}" in args and "--metrics-host=127.0.0.1" in args
    stream = f"K8S{uuid.uuid4().hex[:8].upper()}"
    broker = f"{nats_server.url}?stream={stream}&subjects={stream.lower()}.>"
    topic = f"{stream.lower()}.orders"
    write_events(db_dsn, make_events(topic, 2_000))
    log = tmp_path / "relay.log"
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    relay = spawn_relay(db_dsn, broker, log, *args, log_level=None, env=config, cwd=workdir)
    try:
        startup = container["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        health = container["livenessProbe"]["httpGet"]["path"]
        # within the startup probe's budget, or the kubelet would restart it forever
        _wait("/healthz", budget, lambda: _get(port, health)[0] == 200, relay, log)
        ready = container["readinessProbe"]["httpGet"]["path"]
        _wait("/readyz", 30, lambda: _get(port, ready)[0] == 200, relay, log)
        _wait("the backlog drained", 60, lambda: count(db_dsn) == 0, relay, log)

        # every metric the KEDA query reads is served, with the labels it uses
        query = yaml.safe_load((K8S / "scaledobject.yaml").read_text())["spec"]["triggers"][0]
        status, body = _get(port, "/metrics")
        assert status == 200
        for metric in set(re.findall(r"\boutboxkit_[a-z_]+", query["metadata"]["query"])):
            assert re.search(rf"^{metric}\{{[^}}]*topic=", body, re.M), f"{metric} not served"

        with psycopg.connect(db_dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name LIKE 'outboxkit-relay%'"
            ).fetchone()
        assert row is not None
        (connections,) = row
        assert connections <= 5, f"{connections} connections per relay (docs say a few)"

        assert _files_open_for_writing(relay.pid, {str(log)}) == []
        assert list(workdir.iterdir()) == []

        # SIGTERM while a backlog is being published: out well inside the grace period
        write_events(db_dsn, make_events(topic, 10_000))
        _wait("claims", 30, lambda: count(db_dsn) < 10_000, relay, log)
        relay.send_signal(signal.SIGTERM)
        # before the kubelet's SIGKILL, with exit 0 (measured: 0.4 s on an idle machine)
        assert relay.wait(pod["terminationGracePeriodSeconds"]) == 0, log.read_text()[-3000:]
        assert "stopped" in log.read_text()
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()
