"""The fleet's supervisor in-process: what a reload does to each database's service.

The databases are real (the probe connects to them); the service the fleet runs for each
is a recorder in place of a Relay, so the supervisor's own decisions are what is watched.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from outboxkit.errors import ConfigurationError
from outboxkit.fleet.dsn_file import Database
from outboxkit.fleet.supervisor import DatabaseTag, Fleet
from tests.support.relaying import wait_for


class _Recorder:
    """Runs until stopped; ``fail_first`` runs raise (a relay whose start failed)."""

    def __init__(self, database: Database, log: list[str], fail_first: int = 0) -> None:
        self.database = database
        self.log = log
        self.fail_first = fail_first
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        self.log.append(f"run {self.database.name} {self.database.dsn}")
        if self.fail_first:
            self.fail_first -= 1
            raise ConfigurationError("table missing: run outboxkit migrate")
        await self._stop.wait()
        self.log.append(f"stop {self.database.name}")


async def _running(fleet: Fleet, names: set[str]) -> None:
    await wait_for(
        lambda: {n for n, m in fleet.members.items() if m.state == "running"} == names,
        timeout=10,
        what=f"running: {sorted(names)}",
    )


async def test_reloads_start_stop_and_restart_only_what_changed(
    db_dsn: str, empty_db_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "databases"
    path.write_text(f"a {db_dsn}\nb {empty_db_dsn}\n")
    log: list[str] = []
    fleet = Fleet(path, lambda d: _Recorder(d, log), reload_interval=3600)
    task = asyncio.create_task(fleet.run())
    try:
        await _running(fleet, {"a", "b"})
        first_a = fleet.members["a"]

        # b's line being edited (its DSN does not parse yet): b keeps running as it was
        path.write_text(f"a {db_dsn}\nb postgresql://x:%ZZ@h/d\n")
        fleet.reload()
        await wait_for(lambda: "line 2: the relay's dsn is not" in caplog.text, timeout=5)
        assert fleet.members["b"].state == "running" and "stop b" not in log

        # b's DSN changed: b restarts; a, unchanged, is left alone; c starts
        path.write_text(f"a {db_dsn}\n\nc {db_dsn}\nb {empty_db_dsn}?connect_timeout=7\n")
        fleet.reload()
        await wait_for(lambda: f"run b {empty_db_dsn}?connect_timeout=7" in log, timeout=5)
        await _running(fleet, {"a", "b", "c"})
        assert fleet.members["a"] is first_a and log.count(f"run a {db_dsn}") == 1
        assert log.count("stop b") == 1
        assert fleet.members["b"].database.line == 4

        # a file that cannot be read at a reload: said once, every database goes on
        path.unlink()
        fleet.reload()
        fleet.reload()
        await asyncio.sleep(0.2)
        assert caplog.text.count("cannot read the DSN file") == 1
        assert set(fleet.members) == {"a", "b", "c"}
    finally:
        fleet.stop()
        await asyncio.wait_for(task, 30)
    assert sorted(line for line in log if line.startswith("stop")) == [
        "stop a",
        "stop b",
        "stop b",
        "stop c",
    ]


async def test_a_service_that_fails_is_retried_with_one_log_line(
    db_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "outboxkit.fleet")
    caplog.handler.addFilter(DatabaseTag())  # (as the command's log handler has it)
    path = tmp_path / "databases"
    path.write_text(f"# one\nshop {db_dsn}\n")
    log: list[str] = []
    fleet = Fleet(path, lambda d: _Recorder(d, log, fail_first=3), retry_base=0.02, retry_cap=0.05)
    task = asyncio.create_task(fleet.run())
    try:
        await _running(fleet, {"shop"})
    finally:
        fleet.stop()
        await asyncio.wait_for(task, 30)
    assert log.count(f"run shop {db_dsn}") == 4
    warned = [r for r in caplog.records if "is not relayed" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert "database shop (line 2) is not relayed: table missing" in warned[0].getMessage()
    assert getattr(warned[0], "database", None) == "shop"  # (logged in the member's task)


async def test_a_stop_does_not_wait_for_a_database_that_never_answers(
    db_dsn: str, tmp_path: Path
) -> None:
    """A host that takes the connection and says nothing holds libpq for its connect
    timeout (10 s); the fleet's SIGTERM cancels that try instead of waiting it out."""
    import socket
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # (the kernel completes the handshake; nothing ever answers)
        port = silent.getsockname()[1]
        path = tmp_path / "databases"
        path.write_text(f"shop {db_dsn}\nhung postgresql://postgres@127.0.0.1:{port}/x\n")
        log: list[str] = []
        fleet = Fleet(path, lambda d: _Recorder(d, log), reload_interval=3600)
        task = asyncio.create_task(fleet.run())
        await _running(fleet, {"shop"})
        await asyncio.sleep(0.3)
        assert "hung" not in fleet.members  # (its lease check has not answered)
        started = time.monotonic()
        fleet.stop()
        await asyncio.wait_for(task, 30)
        assert time.monotonic() - started < 3.0
    assert log == [f"run shop {db_dsn}", "stop shop"]
