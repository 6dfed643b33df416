"""Fleet process tests: the ``outboxkit relay --dsn-file`` processes of one file, started and
killed by the test, and what it reads from each database, PostgreSQL's or MariaDB's: the live
owner of its relay's lease (from its own ``outboxkit_fleet`` table, by the database's clock)
and its pending count."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg

from outboxkit.backends.mariadb.sql import is_mysql_url
from tests.support.mariadb_ops import mariadb_execute
from tests.support.relaying import relay_connections, wait_for

_OWNER = "SELECT member FROM outboxkit_fleet WHERE service = %s AND owner AND expires_at > {now}"
_PENDING = "SELECT count(*) FROM outbox WHERE status = 0"


def _mariadb(dsn: str, statement: str, params: tuple[Any, ...]) -> Any:
    import pymysql

    try:
        rows = mariadb_execute(dsn, statement, params)
    except pymysql.err.ProgrammingError as exc:
        if exc.args and exc.args[0] == 1146:  # no lease table yet
            return None
        raise
    return rows[0] if rows else None


def owner(dsn: str, service: str = "relay:outbox") -> str | None:
    """The member (``host:pid:nonce``) whose lease on ``dsn`` runs now, or None."""
    if is_mysql_url(dsn):
        row = _mariadb(dsn, _OWNER.format(now="UTC_TIMESTAMP(6)"), (service,))
    else:
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                row = conn.execute(_OWNER.format(now="now()"), (service,)).fetchone()
            except psycopg.errors.UndefinedTable:
                row = None
    return str(row[0]) if row else None


def owner_pid(dsn: str) -> int | None:
    """The pid of the process owning ``dsn``'s relay, or None."""
    member = owner(dsn)
    return int(member.split(":")[-2]) if member else None


def pending(dsn: str) -> int:
    """Rows of ``dsn``'s outbox not yet published."""
    if is_mysql_url(dsn):
        return int(_mariadb(dsn, _PENDING, ())[0])
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(_PENDING).fetchone()
    assert row is not None
    return int(row[0])


class FleetProcesses:
    """The relay processes of one file (``--fleet-lease lease``, ``--poll-interval poll``)."""

    def __init__(self, dsn_file: Path, broker: str, logs: Path, lease: float, poll: str) -> None:
        self.dsn_file = dsn_file
        self.broker = broker
        self.logs = logs
        self.lease = lease
        self.poll = poll
        self.live: dict[int, subprocess.Popen[bytes]] = {}
        self.ended: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "outboxkit", "relay", "--dsn-file", str(self.dsn_file)]
        cmd += ["--broker", self.broker, "--fleet-lease", str(self.lease), "--lease", "4"]
        cmd += ["--poll-interval", self.poll, "--reload-interval", "600", "--log-level", "info"]
        log = self.logs / f"relay-{len(self.live) + len(self.ended)}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)
            )
        self.live[process.pid] = process
        return process

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        self.ended.append(self.live.pop(process.pid))

    def hup(self) -> None:
        for process in self.live.values():
            process.send_signal(signal.SIGHUP)

    def stop(self) -> list[int | None]:
        """SIGTERM to each live process; their exit codes (None: killed after 30 s)."""
        for process in self.live.values():
            process.send_signal(signal.SIGTERM)
        codes = []
        for process in self.live.values():
            try:
                codes.append(process.wait(30))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(None)
        self.ended += self.live.values()
        self.live.clear()
        return codes

    def log_tail(self) -> str:
        return "\n".join(p.read_text()[-1500:] for p in sorted(self.logs.glob("relay-*.log")))


def claim_connections(dsn: str) -> int:
    """The relay's claim connections to ``dsn`` (MariaDB's are not told apart by name: 1)."""
    if is_mysql_url(dsn):
        return 1
    return relay_connections(dsn).get("outboxkit-relay:claim", 0)


async def balanced(
    fleet: FleetProcesses, listed: list[str], timeout: float, what: str, *, claims: bool = True
) -> float:
    """Wait until every listed database is owned by one live process, each holding its
    ceil(D/N) at most, and (``claims``) only the owner holding a claim connection, its relay
    started; the seconds taken."""
    started = time.monotonic()
    last: dict[str, int | None] = {}

    def settled() -> bool:
        last.clear()
        last.update({dsn: owner_pid(dsn) for dsn in listed})
        if any(pid not in fleet.live for pid in last.values()):
            return False
        share = math.ceil(len(listed) / len(fleet.live))
        if max(Counter(last.values()).values()) > share:
            return False
        if not claims:
            return True
        return all(claim_connections(dsn) == 1 for dsn in listed)

    try:
        await wait_for(settled, timeout=timeout, interval=0.25, what=what)
    except AssertionError:
        owners = Counter(last.values())
        raise AssertionError(f"{what}: owners {owners}\n{fleet.log_tail()}") from None
    took = time.monotonic() - started
    print(f"{what}: {took:.1f} s, owners {sorted(Counter(last.values()).values())}")
    return took
