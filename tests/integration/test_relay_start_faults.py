"""A starting relay stops on configuration errors with one line; it retries only outages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outboxkit.testing import free_port


def _with(dsn: str, **changes: Any) -> str:
    return make_conninfo(**{**conninfo_to_dict(dsn), **changes})


def _relay(dsn: str, *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "outboxkit", "relay", "--broker", "nats://127.0.0.1:1", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OUTBOXKIT_DSN": dsn, "COLUMNS": "60"},
    )


@pytest.mark.parametrize(
    ("changes", "fix", "options"),
    [
        ({"dbname": "outboxkit_no_such_db"}, "check the database name", ()),
        ({"user": "outboxkit_no_such_role"}, "check the user name", ()),
        ({"dbname": "outboxkit_no_such_db"}, "check the database name", ("--source", "cdc")),
    ],
)
def test_a_relay_pointed_at_a_wrong_database_or_role_stops_with_one_line(
    db_dsn: str, changes: dict[str, str], fix: str, options: tuple[str, ...]
) -> None:
    """Before: it logged "database not reachable at start ... retrying" forever (the WAL
    relay: "replication stream ... lost ... reconnecting")."""
    relay = _relay(_with(db_dsn, **changes), *options)
    try:
        _, stderr = relay.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        relay.kill()
        _, stderr = relay.communicate()
        pytest.fail(f"the relay kept retrying a configuration error:\n{stderr[-2000:]}")
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert relay.returncode == 2, stderr[-2000:]
    assert len(errors) == 1 and fix in errors[0], stderr[-2000:]
    assert "Traceback" not in stderr and "partition" not in stderr, stderr[-2000:]


def test_a_relay_whose_database_is_unreachable_keeps_retrying(db_dsn: str, tmp_path: Path) -> None:
    log = tmp_path / "relay.log"
    dsn = _with(db_dsn, host="127.0.0.1", port=str(free_port()))
    with log.open("w") as out:
        relay = subprocess.Popen(
            [sys.executable, "-m", "outboxkit", "relay", "--broker", "nats://127.0.0.1:1"],
            stdout=out, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "OUTBOXKIT_DSN": dsn},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "database not reachable at start" not in log.read_text():
            assert relay.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(1)
        assert relay.poll() is None, log.read_text()[-2000:]  # still retrying
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
    assert "partition maintenance" not in log.read_text(), log.read_text()[-2000:]


def test_the_database_and_role_used_above_really_do_not_exist(db_dsn: str) -> None:
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_database WHERE datname = 'outboxkit_no_such_db'"
        ).fetchone() == (0,)
        assert conn.execute(
            "SELECT count(*) FROM pg_roles WHERE rolname = 'outboxkit_no_such_role'"
        ).fetchone() == (0,)
