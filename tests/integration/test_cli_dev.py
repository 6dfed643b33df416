"""`outboxkit dev` as a new user runs it: a real process, its servers, its data kept across
a stop and a start, and a clear refusal of a port that is taken (issue 32, item 4)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from outboxkit import Event, Outbox
from outboxkit.ops.cli.app import main
from outboxkit.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A data directory PostgreSQL's system user can reach when the tests run as root."""
    base = Path(tempfile.mkdtemp(prefix="outboxkit-dev-test-", dir="/var/tmp"))
    base.chmod(0o711)
    yield base / "data"
    subprocess.run(["rm", "-rf", str(base)], check=False)


def _start(data_dir: Path, *args: str) -> tuple[subprocess.Popen[str], dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "outboxkit", "dev", "--json", "--data-dir", str(data_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise AssertionError(f"outboxkit dev printed nothing: {proc.stderr.read()}")  # type: ignore[union-attr]
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_dev_serves_postgres_and_nats_and_keeps_the_data_for_the_next_start(
    data_dir: Path,
) -> None:
    proc, found = _start(data_dir, "--nats")
    try:
        dsn = str(found["dsn"])
        assert dsn.startswith("postgresql://postgres@127.0.0.1:") and ":5432/" not in dsn
        assert str(found["nats"]).startswith("nats://127.0.0.1:")
        result = CliRunner().invoke(main, ["migrate", "--dsn", dsn])
        assert result.exit_code == 0, result.output
        with psycopg.connect(dsn) as conn, conn.transaction():  # a business row and its event
            conn.execute("CREATE TABLE notes (body text)")
            conn.execute("INSERT INTO notes VALUES ('kept')")
            Outbox().put(conn, Event(topic="notes", event_type="note.added", payload={"n": 1}))
    finally:
        _stop(proc)
    pids = found["pids"]
    assert isinstance(pids, dict) and all(_gone(int(pid)) for pid in pids.values())

    proc, again = _start(data_dir, "--kafka")
    try:
        with psycopg.connect(str(again["dsn"])) as conn:
            assert conn.execute("SELECT body FROM notes").fetchall() == [("kept",)]
            [(topic, payload)] = conn.execute("SELECT topic, payload FROM outbox").fetchall()
            assert (topic, json.loads(payload)) == ("notes", {"n": 1})
        kafka = urllib.parse.urlsplit(str(again["kafka"]))
        assert kafka.hostname == "127.0.0.1" and kafka.port is not None
        socket.create_connection((kafka.hostname, kafka.port), timeout=5).close()
        # a second `outboxkit dev` on the same directory is refused, the first left running
        second = CliRunner().invoke(main, ["dev", "--data-dir", str(data_dir)])
        assert second.exit_code == 2
        assert f"another `outboxkit dev` (pid {proc.pid}) uses" in second.output
        assert proc.poll() is None
    finally:
        _stop(proc)
    pids = again["pids"]
    assert isinstance(pids, dict) and set(pids) == {"postgres", "kafka"}
    assert all(_gone(int(pid)) for pid in pids.values())
    assert not (data_dir / "outboxkit-dev.pid").exists()


def test_dev_refuses_a_port_that_is_taken_in_one_line(data_dir: Path) -> None:
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = CliRunner().invoke(
            main, ["dev", "--data-dir", str(data_dir), "--pg-port", str(port)]
        )
    assert result.exit_code == 2
    assert f"port {port} (--pg-port) is taken" in result.output
    assert "leave it out" in result.output and "Traceback" not in result.output
    assert not data_dir.exists(), "nothing started, nothing written"
