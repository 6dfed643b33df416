"""Importing a consumer runner without its broker's client says which extra to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    ("rabbitmq", "aio_pika", "outboxkit[rabbitmq]"),
    ("redis", "redis", "outboxkit[redis]"),
    ("sqs", "boto3", "outboxkit[sqs]"),
    ("kinesis", "boto3", "outboxkit[sqs]"),
]


@pytest.mark.parametrize(("module", "library", "extra"), CASES)
def test_a_consumer_without_its_client_library_names_the_extra(
    module: str, library: str, extra: str
) -> None:
    # A real failed import in a fresh interpreter: the library is made unimportable.
    code = (
        f"import sys; sys.modules[{library!r}] = None\n"
        f"try:\n    import outboxkit.consumers.{module}\n"
        "except ModuleNotFoundError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("MissingExtraError "), out
    assert f"pip install '{extra}'" in out
    assert out.count("\n") == 1
