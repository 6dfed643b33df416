"""An idle database of ``outboxkit relay --dsn-file`` holds its LISTEN session only.

A real relay process over databases of the session's PostgreSQL, NATS JetStream as the broker,
the claim and settle connections' idle timeouts shortened to 1 s (``OUTBOXKIT_CLAIM_IDLE``,
``OUTBOXKIT_SETTLE_IDLE``; 30 s each by default) and a 30 s poll, so that what the relay
publishes within a few seconds it found by a wake-up on its LISTEN session, not by the poll.
On MariaDB (no LISTEN: it polls on its claim connection) an idle database keeps that one.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outboxkit import Event, Outbox
from outboxkit.testing import create_database, drop_database
from tests.support.relaying import count, make_events, relay_connections, wait_for, write_events
from tests.support.servers import consume_nats, ensure_stream, unique_name

pytestmark = [pytest.mark.exclusive, pytest.mark.timeout(90)]

PARKED = {"outboxkit-relay:listen": 1}
#: A retry's delay: longer than the idle timeout, so its database parks before it is due.
RETRY_IN = 3.0


async def test_idle_databases_hold_their_listen_session_only(
    pg_server: Any, pg_template: str, nats_server: Any, tmp_path: Path
) -> None:
    """Idle, each database holds its LISTEN session only (the claim connection closes once
    its claims found nothing for OUTBOXKIT_CLAIM_IDLE); an event committed then is woken
    for and published within seconds (the poll is 30 s), all of it; a retry due later in a
    parked database is published at its time; one whose LISTEN session is killed unparks and
    publishes what is written then; then all are parked again."""
    names = [unique_name("fleetpark") for _ in range(3)]
    for name in names:
        create_database(pg_server.dsn, name, template=pg_template)
    dsns = [pg_server.dsn_for(name) for name in names]
    root = f"p{uuid.uuid4().hex[:8]}"
    stream = root.upper()
    await ensure_stream(nats_server.url, stream, [f"{root}.>"])
    dsn_file = tmp_path / "databases.txt"
    dsn_file.write_text("".join(f"db{i} {dsn}\n" for i, dsn in enumerate(dsns)))
    cmd = [sys.executable, "-m", "outboxkit", "relay", "--dsn-file", str(dsn_file)]
    cmd += ["--broker", nats_server.url, "--poll-interval", "30"]
    env = {**os.environ, "OUTBOXKIT_CLAIM_IDLE": "1", "OUTBOXKIT_SETTLE_IDLE": "1"}
    log = tmp_path / "relay.log"
    process = _popen(cmd, log, env)
    try:
        # Parked: each database's claim connection closed.
        await wait_for(lambda: all(relay_connections(d) == PARKED for d in dsns), timeout=20)

        # An event committed in a parked database: woken by its NOTIFY, published at once.
        committed = time.monotonic()
        write_events(dsns[0], make_events(f"{root}.db0", 20))
        await wait_for(lambda: count(dsns[0], "status = 0") == 0, timeout=10, what="db0 published")
        woken_in = time.monotonic() - committed
        assert woken_in < 8, f"published {woken_in:.1f}s after its commit: by the poll?"

        # A parked database whose LISTEN session dies (the gate's lock goes with it): the
        # relay unparks and claims on a claim connection, LISTENs again; an event written
        # right after is published within seconds all the same.
        with psycopg.connect(dsns[1], autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname ="
                " current_database() AND application_name = 'outboxkit-relay:listen'"
            )
        committed = time.monotonic()
        write_events(dsns[1], make_events(f"{root}.db1", 5))
        await wait_for(lambda: count(dsns[1], "status = 0") == 0, timeout=10, what="db1 published")
        relisten_in = time.monotonic() - committed
        assert relisten_in < 8, f"published {relisten_in:.1f}s after its commit: by the poll?"

        # A retry in db2, due in RETRY_IN (what a failed publish leaves: attempts, an error, a
        # later available_at), committed with an event due now: that one's NOTIFY unparks the
        # relay, which publishes it and parks again; its probe then sees the retry due later
        # (a delayed row notifies no one) and a timer claims it at its time, not the poll.
        retry = Event(topic=f"{root}.db2", event_type="order.placed", payload={"order": 1},
                      delay=dt.timedelta(seconds=RETRY_IN))  # fmt: skip
        with psycopg.connect(dsns[2]) as conn, conn.transaction():
            Outbox().put_many(conn, [retry, *make_events(f"{root}.db2", 1)])
            row = conn.execute(
                "UPDATE outbox SET attempts = 1, last_error = 'broker: timeout'"
                " WHERE event_id = %s RETURNING extract(epoch FROM available_at)",
                (retry.event_id,),
            ).fetchone()
        assert row is not None
        retry_due = float(row[0])
        await wait_for(lambda: count(dsns[2], "status = 0") == 0, timeout=20, what="the retry")
        late = time.time() - retry_due
        assert late < 8, f"the retry was published {late:.1f}s after it was due"

        got0 = await consume_nats(nats_server.url, stream, f"{root}.db0", None)
        got2 = await consume_nats(nats_server.url, stream, f"{root}.db2", None)
        assert len(got0) == 20 and len({m.header["Nats-Msg-Id"] for m in got0}) == 20
        assert len(got2) == 2
        got1 = await consume_nats(nats_server.url, stream, f"{root}.db1", None)
        assert len(got1) == 5
        # ... and parked again once idle (the settle connection closes too).
        await wait_for(lambda: all(relay_connections(d) == PARKED for d in dsns), timeout=20)
        print(f"db0 published {woken_in * 1000:.0f} ms after its commit; the retry {late:+.1f}s")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        for name in names:
            drop_database(pg_server.dsn, name)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


async def test_an_idle_mariadb_database_holds_its_claim_connection_only(
    mariadb_server: Any, nats_server: Any, tmp_path: Path
) -> None:
    """MariaDB: the settle connection closes once idle as on PostgreSQL; the claim one stays
    (it polls every --poll-interval)."""
    import pymysql

    from outboxkit.backends.mariadb.migrate import migrate
    from tests.support.mariadb_drivers import database

    root = f"m{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    with database(mariadb_server, "fleetidle", migrate) as url:
        name = url.rsplit("/", 1)[1].split("?")[0]
        admin = pymysql.connect(**mariadb_server.connect_args(), autocommit=True)

        def held() -> int:
            with admin.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM information_schema.PROCESSLIST WHERE DB = %s", (name,)
                )
                return int(cur.fetchone()[0])

        def pending() -> int:
            with admin.cursor() as cur:
                cur.execute(f"SELECT count(*) FROM {name}.outbox WHERE status = 0")
                return int(cur.fetchone()[0])

        dsn_file = tmp_path / "databases.txt"
        dsn_file.write_text(f"maria {url}\n")
        cmd = [sys.executable, "-m", "outboxkit", "relay", "--dsn-file", str(dsn_file)]
        cmd += ["--broker", nats_server.url, "--poll-interval", "0.2"]
        env = {**os.environ, "OUTBOXKIT_SETTLE_IDLE": "1"}
        process = _popen(cmd, tmp_path / "relay.log", env)
        try:
            with admin.cursor() as cur:
                cur.execute(
                    f"INSERT INTO {name}.outbox (event_id, topic, event_type, payload, headers)"
                    " VALUES (%s, %s, 'order.placed', '{}', '{}')",
                    (str(uuid.uuid4()), f"{root}.maria"),
                )
            await wait_for(lambda: pending() == 0, timeout=20, what="published")
            await wait_for(lambda: held() == 1, timeout=10, what="the claim connection only")
            got = await consume_nats(nats_server.url, root.upper(), f"{root}.maria", None)
            assert len(got) == 1
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
            admin.close()


def _popen(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
