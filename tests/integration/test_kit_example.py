"""examples/kit_orders: a service tested only with the kit, its tests run as its user runs them.

`pytest` in the example's directory (its own pytest.ini and conftest.py enabling
``outboxkit.pytest``), on this session's PostgreSQL server when one is configured, else on
the kit's embedded one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.servers import PG_DSN_ENV

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kit_orders"


def test_the_example_services_kit_tests_pass() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    if PG_DSN_ENV in os.environ:
        env["OUTBOXKIT_TEST_DSN"] = os.environ[PG_DSN_ENV]
    done = subprocess.run(
        # pytest-asyncio off: the example needs no plugin but the kit (a user may have none).
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:asyncio",
            "-q",
            "-W",
            "error",
        ],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "9 passed" in done.stdout, done.stdout[-2000:]
