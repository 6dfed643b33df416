"""The package root lists what applications import, imports no broker client, and every
exception class outboxkit defines lives in errors.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import outboxkit
from outboxkit import errors

SRC = Path(outboxkit.__file__).parent
BROKER_CLIENTS = {
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
}


def test_every_name_in_all_resolves() -> None:
    missing = [name for name in outboxkit.__all__ if not hasattr(outboxkit, name)]
    assert missing == []
    for name in ("ConsumerRunner", "ReceivedEvent", "Handler", "RelayObserver", "with_routes"):
        assert name in outboxkit.__all__


def test_importing_the_package_imports_no_broker_client() -> None:
    code = "import sys, outboxkit; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert set(out.split()) & BROKER_CLIENTS == set()


def test_exceptions_users_catch_are_exported_from_the_root() -> None:
    for name, obj in vars(errors).items():
        if (
            isinstance(obj, type)
            and issubclass(obj, errors.OutboxkitError)
            and name != "EmbeddedServerUnavailable"  # outboxkit.testing's own
        ):
            assert getattr(outboxkit, name, None) is obj, f"{name} not exported"


def _exception_classes_outside_errors() -> list[str]:
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "errors.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                # (a private class is control flow inside one module, never raised to users)
                private = node.name.startswith("_")
                if not private and any(
                    b.endswith(("Error", "Exception", "Unavailable")) for b in bases
                ):
                    found.append(f"{path.relative_to(SRC)}:{node.name}")
    return found


def test_every_exception_class_lives_in_errors_py() -> None:
    assert _exception_classes_outside_errors() == []
