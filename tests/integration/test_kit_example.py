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


THREE_LINES = """
from outboxkit import Event, Outbox


def test_order_placed(outboxkit_postgres, outbox_events):
    with outboxkit_postgres.connect() as conn, conn.transaction():
        Outbox().put(conn, Event(topic="orders", event_type="order.placed", payload={"id": 1}))
    outbox_events.assert_published(event_type="order.placed", payload={"id": 1})
"""


def _run_kit(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """pytest on ``source`` with `-p outboxkit.pytest` only: no conftest, no ini file."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # keeps pytest from finding ours
    (tmp_path / "test_orders.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", PG_DSN_ENV)}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    options = ["--outboxkit-dsn", os.environ[PG_DSN_ENV]] if PG_DSN_ENV in os.environ else []
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:asyncio",
         "-p", "outboxkit.pytest", "-q", "-W", "error", *options],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_three_line_test_runs_with_dash_p_and_the_dsn_option(tmp_path: Path) -> None:
    """`-p outboxkit.pytest --outboxkit-dsn ...`, nothing else: no conftest, no ini file."""
    done = _run_kit(tmp_path, THREE_LINES)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout, done.stdout[-2000:]


def test_a_failing_assert_published_points_at_the_test_not_the_kit(tmp_path: Path) -> None:
    """pytest's report of a failing `assert_published` ends at the test's own line; the
    kit's frame (its raise) was shown under it (`__tracebackhide__`)."""
    failing = THREE_LINES.replace(
        'outbox_events.assert_published(event_type="order.placed", payload={"id": 1})',
        'outbox_events.assert_published(event_type="order.placed", payload={"id": 2})',
    )
    done = _run_kit(tmp_path, failing)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    assert "expected one outbox event matching" in done.stdout
    assert 'payload={"id": 2})' in done.stdout  # the test's line is the one shown
    assert "outboxkit/pytest.py" not in done.stdout and "raise AssertionError" not in done.stdout


def test_a_server_refusing_the_kit_fails_in_one_line_without_the_password(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_orders.py").write_text(THREE_LINES)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", PG_DSN_ENV)}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    refused = "postgresql://nobody:S3cretPw@127.0.0.1:1/postgres"  # nothing listens on port 1
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:asyncio",
         "-p", "outboxkit.pytest", "-q", "--outboxkit-dsn", refused],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "outboxkit_postgres: cannot create a database on the server of --outboxkit-dsn" in (
        done.stdout
    ), done.stdout[-2000:]
    assert "S3cretPw" not in done.stdout + done.stderr
    assert "Traceback" not in done.stdout
