"""The dashboard against hostile clients: real HTTP requests, a served dashboard, a live database.

DNS rebinding (the Host header), token guessing, short tokens, malformed ids,
a burst of requests against the database's connection limit, and 300 topics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import psycopg
import pytest

from outboxkit import Event
from outboxkit.errors import ConfigurationError
from outboxkit.ops.dashboard import OTHER_TOPICS, POOL_SIZE, Dashboard, dashboard_app
from outboxkit.ops.http import serving
from tests.support.relaying import count, wait_for, write_events

TOKEN = "t0ken-" + uuid.uuid4().hex


@contextlib.asynccontextmanager
async def served(board: Dashboard, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """The dashboard behind the same guarded server the CLI runs it on."""
    async with serving(dashboard_app(board), host, 0, what="dashboard") as site:
        yield f"http://127.0.0.1:{site.port}"


def _failed_event(dsn: str, topic: str = "orders") -> int:
    event = Event(topic=topic, event_type="order.placed", payload={"n": 1})
    write_events(dsn, [event])
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "UPDATE outbox SET status = 2, attempts = 10, last_error = 'boom'"
            " WHERE event_id = %s RETURNING id",
            (event.event_id,),
        ).fetchone()
    assert row is not None
    return int(row[0])


async def test_dashboard_answers_only_to_its_own_host_names(db_dsn: str) -> None:
    board = Dashboard(db_dsn, host="127.0.0.1", allowed_hosts=["dash.internal"])
    async with served(board) as url, aiohttp.ClientSession() as s:
        port = url.rsplit(":", 1)[1]

        async def status(host: str, path: str = "/api/overview") -> int:
            async with s.get(f"{url}{path}", headers={"Host": host}) as resp:
                if resp.status == 403:
                    assert "--allow-host" in await resp.text()
                    assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
                return resp.status

        # a rebound attacker name is refused on every path, the page and the API alike
        for evil in (f"evil.example:{port}", "evil.example", "attacker.test.", "127.0.0.1.evil"):
            assert await status(evil) == 403, evil
            assert await status(evil, "/") == 403, evil
        for good in (
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            "app.localhost",
            f"[::1]:{port}",
            f"10.1.2.3:{port}",
            "dash.internal",
            f"DASH.internal:{port}",
        ):
            assert await status(good) == 200, good


async def test_wrong_tokens_are_slowed_down_and_logged_once_per_window(
    db_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    row_id = _failed_event(db_dsn)
    board = Dashboard(db_dsn, admin_token=TOKEN, token_failure_window=2.0)
    caplog.set_level(logging.WARNING, logger="outboxkit.dashboard")
    async with served(board) as url, aiohttp.ClientSession() as s:

        async def replay(token: str) -> aiohttp.ClientResponse:
            async with s.post(
                f"{url}/api/events/{row_id}/replay", headers={"X-Outboxkit-Token": token}
            ) as resp:
                await resp.read()
                return resp

        statuses = [(await replay(f"guess-{i:012d}")).status for i in range(30)]
        assert statuses[:5] == [403] * 5
        assert set(statuses[5:]) == {429}, statuses
        blocked = await replay(TOKEN)
        assert blocked.status == 429, "while slowed down even the right token waits"
        assert 1 <= int(blocked.headers["Retry-After"]) <= 3
        assert count(db_dsn, "status = 2") == 1, "nothing was replayed"
        refusals = [r for r in caplog.records if "wrong admin token" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in refusals]

        await asyncio.sleep(2.2)  # the window passes
        assert (await replay(TOKEN)).status == 200
        assert count(db_dsn, "status = 2") == 0


def test_an_admin_token_shorter_than_16_characters_is_refused(db_dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="at least 16"):
        Dashboard(db_dsn, admin_token="hunter2")
    Dashboard(db_dsn, admin_token="x" * 16)  # 16 is enough
    for command in (
        ["dashboard", "--dsn", db_dsn, "--port", "0"],
        ["relay", "--dsn", db_dsn, "--broker", "nats://127.0.0.1:1", "--metrics-port", "0"],
    ):
        extra = ["--dashboard"] if command[0] == "relay" else []
        done = subprocess.run(
            [sys.executable, "-m", "outboxkit", *command, *extra, "--admin-token", "hunter2"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done
        assert "at least 16" in done.stderr + done.stdout, done
        assert "openssl rand" in done.stderr + done.stdout


async def test_malformed_event_ids_are_answered_400_not_500(db_dsn: str) -> None:
    board = Dashboard(db_dsn, admin_token=TOKEN)
    bad = ["²", "%C2%B2", "١٢", "99999999999999999999", "9223372036854775808", "-1", "1e3", "0x1"]
    async with served(board) as url, aiohttp.ClientSession() as s:
        for ref in bad:
            async with s.get(f"{url}/api/events/{ref}") as resp:
                assert resp.status == 400, (ref, resp.status, await resp.text())
            async with s.post(
                f"{url}/api/events/{ref}/replay", headers={"X-Outboxkit-Token": TOKEN}
            ) as resp:
                assert resp.status == 400, (ref, resp.status)
        async with s.get(f"{url}/api/events/9223372036854775807") as resp:
            assert resp.status == 404, "the largest bigint is a valid id, just absent"


def _connections(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(open now, opened ever) of the test's database, this connection left out."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM pg_stat_activity"
        "        WHERE datname = current_database() AND pid <> pg_backend_pid()),"
        " sessions FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def test_a_burst_of_requests_reuses_a_few_database_connections(db_dsn: str) -> None:
    row_id = _failed_event(db_dsn)
    board = Dashboard(db_dsn, admin_token=TOKEN, sample_interval=0.2)
    open_now: list[int] = []
    # 300 requests at once over 32 connections (beyond the server's cap of 64 it answers 503)
    connector = aiohttp.TCPConnector(limit=32)
    with psycopg.connect(db_dsn, autocommit=True) as watch_conn:
        _open, sessions_before = _connections(watch_conn)
        async with served(board) as url, aiohttp.ClientSession(connector=connector) as s:

            async def get(path: str) -> int:
                async with s.get(f"{url}{path}") as resp:
                    await resp.read()
                    return resp.status

            async def watch() -> None:
                while True:
                    open_now.append((await asyncio.to_thread(_connections, watch_conn))[0])
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            try:
                paths = ["/api/overview", "/api/failed", f"/api/events/{row_id}"] * 100
                statuses = await asyncio.gather(*(get(p) for p in paths))
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            assert statuses == [200] * len(paths)
            _open, sessions_after = _connections(watch_conn)
            opened = sessions_after - sessions_before
            assert opened <= POOL_SIZE, f"{opened} database connections for 300 requests"
            assert open_now and max(open_now) <= POOL_SIZE, open_now

            # the server ends the kept connections: the next requests reconnect, once
            watch_conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            assert await get(f"/api/events/{row_id}") == 200
            assert await get("/api/failed") == 200
        await wait_for(
            lambda: _connections(watch_conn)[0] == 0, timeout=10, what="closed with the app"
        )


async def test_the_topic_list_stays_bounded_with_300_topics(db_dsn: str) -> None:
    events = [
        Event(topic=f"tenant-{i:03d}.orders", event_type="x", payload={})
        for i in range(300)
        for _ in range(1 + (i % 3))
    ]
    write_events(db_dsn, events)
    board = Dashboard(db_dsn, max_topics=20, sample_interval=0.2)
    async with served(board) as url, aiohttp.ClientSession() as s:
        async with s.get(f"{url}/api/overview") as resp:
            overview: dict[str, Any] = await resp.json()
    topics = overview["status"]["topics"]
    assert len(topics) == 21
    assert topics[-1]["topic"] == OTHER_TOPICS
    assert sum(t["pending"] for t in topics) == len(events) == overview["status"]["pending"]
    listed = [t for t in topics if t["topic"] != OTHER_TOPICS]
    assert all(t["pending"] == 3 for t in listed), "the busiest topics are the ones listed"
    assert len(board._topics) <= 20
