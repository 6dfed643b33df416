"""Blocked keys in `outboxkit status` and the dashboard (ordered mode, policy block).

A real ordered relay publishes to NATS; the head event of one key goes to a subject no
stream stores, so the broker rejects it and it is dead-lettered; its key's later events
wait behind it while another key flows. `outboxkit status` (table and --json), the
dashboard's API (alone and mounted in the relay's HTTP server) and its page show the
blocked key with the head event's error; replaying the head once the cause is fixed
unblocks the key.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from click.testing import CliRunner

from outboxkit import Event
from outboxkit.ops.cli import main
from outboxkit.ops.dashboard import Dashboard, dashboard_app
from outboxkit.ops.http import metrics_app
from outboxkit.ops.metrics import RelayMetrics
from outboxkit.publishers.nats import NatsPublisher
from tests.support.relaying import count, rows, running_relay, wait_for, write_events
from tests.support.servers import ensure_stream

CHROMIUM = os.environ.get("OUTBOXKIT_CHROMIUM", "/usr/bin/chromium")
TOKEN = "t0ken-" + uuid.uuid4().hex


@contextlib.asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    async with TestServer(app, host="127.0.0.1") as server:
        yield str(server.make_url("")).rstrip("/")


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def _status(dsn: str, *extra: str) -> str:
    result = CliRunner().invoke(main, ["status", "--dsn", dsn, *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def ordered_dsn(db_dsn: str) -> str:
    from outboxkit.backends.postgres.migrate import migrate

    migrate(db_dsn, table="outbox", ordered=True, partitions=4)
    return db_dsn


async def test_a_blocked_key_shows_in_status_and_the_dashboard_until_its_head_is_replayed(
    ordered_dsn: str, nats_server: Any
) -> None:
    dsn = ordered_dsn
    root = f"b{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.orders"])
    unstored = f"{root}.audit"  # no stream stores it yet: NATS rejects the head event
    head = Event(topic=unstored, event_type="account.opened", key="acct-1", payload={"n": 0})
    behind = [
        Event(topic=f"{root}.orders", event_type="account.changed", key="acct-1", payload={"n": i})
        for i in (1, 2)
    ]
    other = [
        Event(topic=f"{root}.orders", event_type="account.changed", key="acct-2", payload={"n": i})
        for i in range(3)
    ]
    write_events(dsn, [head, *behind, *other])
    publisher = NatsPublisher.from_url(f"{nats_server.url}?timeout=1")
    options: dict[str, Any] = {"ordered": True, "dead_letter_policy": "block", "max_attempts": 1}
    async with running_relay(dsn, publisher, **options):
        await wait_for(lambda: count(dsn, "key = 'acct-2'") == 0, what="acct-2 flows")
        await wait_for(lambda: count(dsn, "status = 2") == 1, what="the head dead-lettered")
        [dead] = rows(dsn, "status = 2")
        assert dead["event_id"] == head.event_id
        assert count(dsn, "key = 'acct-1' AND status = 0") == 2  # waiting behind it

        # outboxkit status --json: the key, its head and the head's error
        report = json.loads(_status(dsn, "--json"))
        [blocked] = report["blocked_keys"]
        assert blocked["key"] == "acct-1"
        assert blocked["id"] == dead["id"] and blocked["event_id"] == str(head.event_id)
        assert blocked["topic"] == unstored and blocked["waiting"] == 2
        assert blocked["last_error"] == dead["last_error"] and blocked["last_error"]
        # ... and the table
        text = _status(dsn)
        assert "1 blocked key(s)" in text and "acct-1" in text
        assert str(dead["last_error"]).split()[0] == "nats:" and "nats:" in text  # (wrapped)

        # the dashboard's API, on its own and inside the relay's HTTP server
        board = Dashboard(dsn, admin_token=TOKEN, sample_interval=0.5)
        async with served(dashboard_app(board)) as url:
            [shown] = await _get(f"{url}/api/blocked")
            assert (shown["key"], shown["id"], shown["waiting"]) == ("acct-1", dead["id"], 2)
            assert shown["last_error"] == dead["last_error"]
            await _page_shows_and_replays(url, dead["id"], dead["last_error"], nats_server, root)
        relay_http = metrics_app(
            RelayMetrics(dsn, process_metrics=False), dashboard=dashboard_app(Dashboard(dsn))
        )
        async with served(relay_http) as url:
            assert await _get(f"{url}/dashboard/api/blocked") == []  # replayed meanwhile

        await wait_for(lambda: count(dsn, "key = 'acct-1'") == 0, what="acct-1 unblocked")
    assert json.loads(_status(dsn, "--json"))["blocked_keys"] == []
    assert "blocked key" not in _status(dsn)


async def _page_shows_and_replays(
    url: str, head_id: int, error: str, nats_server: Any, root: str
) -> None:
    """The page lists the key with the error; replay (after the fix) from the page."""
    fix = ensure_stream(nats_server.url, f"{root.upper()}AUDIT", [f"{root}.audit"])
    if not os.path.exists(CHROMIUM):  # noqa: ASYNC240 - one stat before launching
        await fix
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"{url}/api/events/{head_id}/replay", headers={"X-Outboxkit-Token": TOKEN}
            ) as resp:
                assert resp.status == 200, await resp.text()
        return
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("dialog", lambda d: d.accept())
            await page.goto(url)
            await page.wait_for_selector('#blocked tr[data-key="acct-1"]')
            row = page.locator('#blocked tr[data-key="acct-1"]')
            assert await row.locator("td.err").text_content() == error
            assert await page.text_content("#blocked-count") == "(1)"
            await fix
            await page.fill("#token", TOKEN)
            await page.click("#token-save")
            await row.locator("button.replay").click()
            await page.wait_for_selector("#blocked-section", state="hidden")
        finally:
            await browser.close()


def test_status_of_an_unordered_table_lists_no_blocked_keys(db_dsn: str) -> None:
    write_events(db_dsn, [Event(topic="t", event_type="x", key="k", payload={})])
    assert json.loads(_status(db_dsn, "--json"))["blocked_keys"] == []
    assert "blocked" not in _status(db_dsn)
