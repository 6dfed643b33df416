"""The web dashboard in a real headless Chromium, against a live database and a real broker."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from aiohttp import web

from outboxkit import Event
from outboxkit.ops.dashboard import Dashboard, dashboard_app
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.testing import free_port
from tests.support.relaying import count, running_relay, wait_for, write_events
from tests.support.servers import consume_nats, ensure_stream, require_or_skip

CHROMIUM = os.environ.get("OUTBOXKIT_CHROMIUM", "/usr/bin/chromium")
TOKEN = "t0ken-" + uuid.uuid4().hex
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.png"
XSS_PAYLOAD = {"note": "<script>window.__pwned = 1</script>", "total": 42}
XSS_ERROR = '<img src=x onerror="window.__pwned = 2"> broker said no'


@contextlib.asynccontextmanager
async def served(board: Dashboard) -> AsyncIterator[str]:
    runner = web.AppRunner(dashboard_app(board), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Any]:
    if not os.path.exists(CHROMIUM):  # noqa: ASYNC240 - one stat before launching
        require_or_skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            yield browser
        finally:
            await browser.close()


def accepting_dialogs(page: Any) -> list[str]:
    """Confirm every dialog the page opens (discard, cancel); their messages, as they come."""
    dialogs: list[str] = []

    async def accept(dialog: Any) -> None:
        dialogs.append(dialog.message)
        await dialog.accept()

    page.on("dialog", accept)
    return dialogs


def _fail_events(dsn: str, events: list[Event], error: str) -> list[int]:
    """Dead-letter events the way the relay does (status 2, attempts, last_error)."""
    ids = [str(e.event_id) for e in events]
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "UPDATE outbox SET status = 2, attempts = 10, last_error = %s"
            " WHERE event_id::text = ANY(%s) RETURNING id",
            (error, ids),
        ).fetchall()
    return sorted(r[0] for r in rows)


def _db_totals(dsn: str) -> dict[str, int]:
    return {
        "backlog": count(dsn, "status = 0"),
        "failed": count(dsn, "status = 2"),
    }


async def test_dashboard_shows_the_table_replays_through_the_ui_and_escapes_payloads(
    db_dsn: str, nats_server: Any, tmp_path: Path
) -> None:
    root = f"d{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    orders, payments = f"{root}.orders", f"{root}.payments"
    pending = [
        Event(topic=orders if i % 3 else payments, event_type="order.placed", payload={"i": i})
        for i in range(7)
    ]
    doomed = [
        Event(
            topic=orders,
            event_type="order.shipped",
            payload=XSS_PAYLOAD,
            key="customer-7",
            headers={"tenant": "<b>acme</b>"},
        ),
        Event(topic=payments, event_type="payment.captured", payload={"amount": 1999}),
    ]
    write_events(db_dsn, pending + doomed)
    failed_ids = _fail_events(db_dsn, doomed, XSS_ERROR)
    xss_id = failed_ids[0]
    totals = _db_totals(db_dsn)
    assert totals == {"backlog": 7, "failed": 2}

    board = Dashboard(db_dsn, admin_token=TOKEN, sample_interval=0.5)
    async with served(board) as url, chromium() as browser:
        page = await browser.new_page(viewport={"width": 1400, "height": 1100})
        dialogs = accepting_dialogs(page)
        await page.goto(url)
        await page.wait_for_selector(f'#failed tr[data-id="{xss_id}"]')

        # the numbers shown are the table's
        assert await page.text_content("#total-backlog") == str(totals["backlog"])
        assert await page.text_content("#total-failed") == str(totals["failed"])
        assert await page.text_content("#total-in-flight") == "0"
        assert (await page.text_content("#oldest-age") or "").endswith("s")
        topic_rows = await page.eval_on_selector_all(
            "#topics tbody tr",
            "rows => rows.map(r => [...r.cells].slice(0, 4).map(c => c.textContent))",
        )
        with psycopg.connect(db_dsn) as conn:
            expected = conn.execute(
                "SELECT topic, count(*) FILTER (WHERE status = 0),"
                " 0, count(*) FILTER (WHERE status = 2)"
                " FROM outbox GROUP BY topic ORDER BY topic"
            ).fetchall()
        assert topic_rows == [[t, str(p), str(f0), str(f)] for t, p, f0, f in expected]

        # attacker-controlled text is shown as text, never run or parsed as markup
        row = page.locator(f'#failed tr[data-id="{xss_id}"]')
        assert await row.locator("td.err").text_content() == XSS_ERROR
        await row.locator("button.view").click()
        await page.wait_for_selector("#detail:not([hidden])")
        shown = await page.text_content("#detail-payload") or ""
        assert "<script>window.__pwned = 1</script>" in shown
        assert '"total": 42' in shown, "JSON payloads are pretty-printed"
        assert await page.locator("#detail script, #failed script, #detail img").count() == 0
        headers_text = await page.text_content("#detail-headers") or ""
        assert "<b>acme</b>" in headers_text
        assert await page.evaluate("window.__pwned") is None
        await page.wait_for_timeout(1200)  # a couple of samples for the charts
        shot = _screenshot_path(tmp_path)
        await page.screenshot(path=str(shot), full_page=True)

        # actions need the token: without it the API refuses and nothing changes
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/api/events/{xss_id}/replay") as resp:
                assert resp.status == 403
            async with s.post(
                f"{url}/api/events/{xss_id}/replay", headers={"X-Outboxkit-Token": "nope"}
            ) as resp:
                assert resp.status == 403
        assert count(db_dsn, "status = 2") == 2

        # replay through the UI with a relay running: the event reaches NATS
        await page.fill("#token", TOKEN)
        await page.click("#token-save")
        async with running_relay(db_dsn, NatsPublisher.from_url(nats_server.url)):
            await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="pending drained")
            await page.locator(f'#failed tr[data-id="{xss_id}"] button.replay').click()
            await wait_for(
                lambda: count(db_dsn, f"id = {xss_id}") == 0, what="replayed event published"
            )
        throughput = [p["throughput"] for p in board.history if p["throughput"] is not None]
        assert max(throughput) > 0, "the 8 published events show in the throughput chart"
        msgs = await consume_nats(nats_server.url, root.upper(), f"{root}.>", 8, 15.0)
        published = {m.headers["Nats-Msg-Id"]: m for m in msgs}
        assert str(doomed[0].event_id) in published
        assert published[str(doomed[0].event_id)].data == doomed[0].payload
        assert str(doomed[1].event_id) not in published, "only the replayed one"
        await page.wait_for_selector(f'#failed tr[data-id="{xss_id}"]', state="detached")

        async def failed_total_shown() -> bool:
            return await page.text_content("#total-failed") == "1"

        await wait_for(failed_total_shown, what="failed total refreshed to 1")

        # discard (asks for confirmation) deletes the dead letter for good
        other = failed_ids[1]
        await page.locator(f'#failed tr[data-id="{other}"] button.discard').click()
        await wait_for(lambda: count(db_dsn, f"id = {other}") == 0, what="discarded")
        assert dialogs and str(other) in dialogs[0]
        await page.wait_for_selector("#no-failed:not([hidden])")


async def test_dashboard_without_a_token_is_read_only(db_dsn: str) -> None:
    [event] = [Event(topic="t", event_type="x", payload={})]
    write_events(db_dsn, [event])
    [row_id] = _fail_events(db_dsn, [event], "boom")
    board = Dashboard(db_dsn, sample_interval=0.5)
    async with served(board) as url, chromium() as browser:
        page = await browser.new_page()
        await page.goto(url)
        await page.wait_for_selector(f'#failed tr[data-id="{row_id}"]')
        assert await page.text_content("#mode") == "read-only"
        assert await page.locator("button.replay").is_disabled()
        assert await page.locator("button.discard").is_disabled()
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"{url}/api/events/{row_id}/discard", headers={"X-Outboxkit-Token": ""}
            ) as resp:
                assert resp.status == 403
                assert "read-only" in (await resp.json())["error"]
            async with s.get(url) as resp:
                assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    assert count(db_dsn, "status = 2") == 1


def _screenshot_path(tmp_path: Path) -> Path:
    """docs/img/dashboard.png when OUTBOXKIT_UPDATE_SCREENSHOT=1, else a throwaway file."""
    if os.environ.get("OUTBOXKIT_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        return SCREENSHOT
    return tmp_path / "dashboard.png"


async def test_an_events_credential_headers_are_masked_by_name(db_dsn: str) -> None:
    """`Bearer s3cr3t` (too short for the Bearer net), `Token abcdefghijkl` and a cookie
    were shown as they are: a header named for a credential is masked whatever its value."""
    event = Event(
        topic="t",
        event_type="x",
        payload={},
        headers={
            "Authorization": "Bearer s3cr3t",
            "x-api-token": "Token abcdefghijkl",
            "cookie": "session=zq8wv",
            "x-client-secret": "plain",
            "x-app-idempotency-key": "order-77",
            "x-tenant": "acme",
        },
    )
    write_events(db_dsn, [event])
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute("SELECT id FROM outbox").fetchone()
    assert row is not None
    async with served(Dashboard(db_dsn)) as url, aiohttp.ClientSession() as s:
        async with s.get(f"{url}/api/events/{row[0]}") as resp:
            shown = (await resp.json())["headers"]
    assert shown == {
        "Authorization": "***",
        "x-api-token": "***",
        "cookie": "***",
        "x-client-secret": "***",
        "x-app-idempotency-key": "order-77",
        "x-tenant": "acme",
    }


async def test_actions_wait_for_the_token_and_the_failed_count_is_the_cards(
    db_dsn: str,
) -> None:
    """Before: replay and discard looked active on an admin dashboard before any token was
    entered (a click was only refused), and the heading counted the rows the list read
    (`(100+)`, or one off the card when a dead letter landed between the two reads)."""
    events = [Event(topic="t", event_type="x", payload={"n": n}) for n in range(120)]
    write_events(db_dsn, events)
    ids = _fail_events(db_dsn, events, "boom")
    board = Dashboard(db_dsn, admin_token=TOKEN, sample_interval=0.5)
    async with served(board) as url, chromium() as browser:
        page = await browser.new_page()
        await page.goto(url)
        await page.wait_for_selector(f'#failed tr[data-id="{ids[0]}"]')
        assert await page.text_content("#total-failed") == "120"
        assert await page.text_content("#failed-count") == "(120, 100 shown)"
        replay = page.locator(f'#failed tr[data-id="{ids[0]}"] button.replay')
        assert await replay.is_disabled()
        assert await replay.get_attribute("title") == "enter the admin token above to act"
        await page.fill("#token", TOKEN)
        await page.click("#token-save")
        await page.wait_for_selector(
            f'#failed tr[data-id="{ids[0]}"] button.replay:not([disabled])'
        )
        await replay.click()
        await wait_for(lambda: count(db_dsn, "status = 2") == 119, what="replayed")


async def test_a_drained_topic_stays_listed_with_what_was_published_recently(
    db_dsn: str,
) -> None:
    """Before: a topic whose events were all published and deleted stayed as a row of zeros
    (or, with the list full, vanished): nothing said it had been busy a minute ago."""
    write_events(db_dsn, [Event(topic="flash", event_type="x", payload={"n": n}) for n in range(5)])
    write_events(db_dsn, [Event(topic="steady", event_type="x", payload={})])
    board = Dashboard(db_dsn, sample_interval=0.3)
    async with served(board) as url, chromium() as browser:
        page = await browser.new_page(viewport={"width": 1400, "height": 1100})
        await page.goto(url)
        await page.wait_for_selector('#topics tr[data-topic="flash"]')
        cells = "row => [...row.cells].map(c => c.textContent)"
        flash = await page.eval_on_selector('#topics tr[data-topic="flash"]', cells)
        assert flash[1] == "5"
        assert flash[5] == "0"
        with psycopg.connect(db_dsn) as conn:  # the relay's publish-and-delete, as it lands
            conn.execute("DELETE FROM outbox WHERE topic = 'flash'")
        await page.wait_for_function(
            """() => document.querySelector('#topics tr[data-topic="flash"]')
               ?.cells[5].textContent === '5'"""
        )
        flash = await page.eval_on_selector('#topics tr[data-topic="flash"]', cells)
        assert flash[1:4] == ["0", "0", "0"]
        steady = await page.eval_on_selector('#topics tr[data-topic="steady"]', cells)
        assert steady[1] == "1"
        assert steady[5] == "0"
