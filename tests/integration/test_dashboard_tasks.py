"""The dashboard's Tasks page in a real headless Chromium and over HTTP, against live PostgreSQL
and a real task worker: states, filters, escaping, replay / cancel / discard, and hostile clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import psycopg
import pytest
from aiohttp import web

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.errors import TableNotFoundError
from outboxkit.ops.dashboard import Dashboard
from outboxkit.queue.tasks import TaskStatus
from outboxkit.tasks import TaskContext, Tasks, Worker
from outboxkit.testing import free_port
from tests.integration.test_dashboard import accepting_dialogs, chromium, served
from tests.support.relaying import wait_for

TABLE = "outboxkit_tasks"
TOKEN = "t0ken-" + uuid.uuid4().hex
HOSTILE_PAYLOAD = {"note": "<script>window.__pwned = 1</script>", "total": 42}
HOSTILE_ERROR = '<img src=x onerror="window.__pwned = 2"> card declined'


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    yield db_dsn


@contextlib.asynccontextmanager
async def running_worker(tasks: Tasks, dsn: str, queues: list[str]) -> AsyncIterator[Worker]:
    """A real worker in this event loop (the page and the browser share it), stopped after."""
    worker = Worker(tasks, dsn, queues=queues, lease=0.6, poll_interval=0.05)
    run = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.stop()
        await run


def _status(dsn: str, task_id: int) -> int | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT status FROM {TABLE} WHERE id = %s", (task_id,)).fetchone()
    return None if row is None else int(row[0])


def _enqueue(dsn: str, tasks: Tasks, name: str, payload: Any = None, **options: Any) -> int:
    with psycopg.connect(dsn) as conn, conn.transaction():
        tasks.enqueue(conn, name, payload, **options)
        row = conn.execute(f"SELECT max(id) FROM {TABLE}").fetchone()
    assert row is not None
    return int(row[0])


def _counts_by_name(dsn: str) -> list[list[str]]:
    """The table's own counts per task name (queued, scheduled, running, failed), by the
    database's clock: what the page must show."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f"SELECT task_name, count(*) FILTER (WHERE status = 0 AND available_at <= now()),"
            f" count(*) FILTER (WHERE status = 0 AND available_at > now()),"
            f" count(*) FILTER (WHERE status = 1), count(*) FILTER (WHERE status = 3)"
            f" FROM {TABLE} GROUP BY task_name ORDER BY task_name"
        ).fetchall()
    return [[str(v) for v in row] for row in rows]


async def test_the_tasks_page_shows_escapes_filters_acts_and_refuses_a_cross_site_page(
    tasks_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    tasks = Tasks()
    fixed = threading.Event()
    charges: list[tuple[int, int]] = []
    report_started = asyncio.Event()
    cancelled: list[int] = []

    @tasks.handler("invoice.charge", max_attempts=1)
    def charge(payload: Any, ctx: TaskContext) -> None:
        charges.append((ctx.id, ctx.attempt))
        if not fixed.is_set():
            raise RuntimeError(HOSTILE_ERROR)

    @tasks.handler("report.generate")
    async def generate(payload: Any, ctx: TaskContext) -> None:
        report_started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(ctx.id)
            raise

    @tasks.handler("mail.send")
    def send(payload: Any) -> None:
        raise AssertionError("no worker takes the mail queue in this test")

    # a failed task with a hostile payload and error, failed by a real worker
    invoice = _enqueue(tasks_dsn, tasks, "invoice.charge", HOSTILE_PAYLOAD)
    async with running_worker(tasks, tasks_dsn, ["default"]):
        await wait_for(
            lambda: _status(tasks_dsn, invoice) == TaskStatus.FAILED, what="invoice failed"
        )
    mails = [_enqueue(tasks_dsn, tasks, "mail.send", {"to": f"u{i}"}, queue="mail") for i in (1, 2)]
    later = _enqueue(tasks_dsn, tasks, "mail.send", {"to": "u3"}, queue="mail", delay=3600)
    report = _enqueue(tasks_dsn, tasks, "report.generate", {"month": 11}, queue="reports")

    board = Dashboard(tasks_dsn, admin_token=TOKEN, sample_interval=0.5)
    async with served(board) as url, chromium() as browser:
        page = await browser.new_page(viewport={"width": 1400, "height": 1100})
        dialogs = accepting_dialogs(page)
        async with served(Dashboard(tasks_dsn, tasks_table="never_migrated")) as bare:
            await page.goto(bare + "/tasks")  # no such table: the page says how to create it
            await page.wait_for_selector("#missing:not([hidden])")
            text = await page.text_content("#missing") or ""
            assert "outboxkit migrate --tasks" in text and "never_migrated" in text
            assert await page.locator("#present").is_hidden()

        await page.goto(url + "/")
        await page.click("#nav-tasks")  # the outbox's page links to the tasks page
        await page.wait_for_selector(f'#tasks tr[data-id="{invoice}"]')  # failed, by default

        # the numbers shown are the table's
        expected = _counts_by_name(tasks_dsn)
        totals = [str(sum(int(row[i]) for row in expected)) for i in range(1, 5)]
        assert totals == ["3", "1", "0", "1"]
        states = ("queued", "scheduled", "running", "failed")
        assert [await page.text_content(f"#total-{k}") for k in states] == totals
        assert (await page.text_content("#oldest-age") or "").endswith("s")
        names = await page.eval_on_selector_all(
            "#names tbody tr",
            "rows => rows.map(r => [...r.cells].slice(0, 5).map(c => c.textContent))",
        )
        assert names == expected

        # attacker-controlled payload, error and traceback are shown as text, never run
        row = page.locator(f'#tasks tr[data-id="{invoice}"]')
        assert await row.locator("td.err").text_content() == f"RuntimeError: {HOSTILE_ERROR}"
        await row.locator("button.view").click()
        await page.wait_for_selector("#detail:not([hidden])")
        assert "<script>window.__pwned = 1</script>" in (
            await page.text_content("#detail-payload") or ""
        )
        assert HOSTILE_ERROR in (await page.text_content("#detail-error") or "")
        traceback = await page.text_content("#detail-traceback") or ""
        assert "RuntimeError" in traceback and "charge" in traceback
        assert (
            await page.locator("#detail script, #detail img, #tasks script, #tasks img").count()
            == 0
        )
        assert await page.evaluate("window.__pwned") is None

        # filters: state and queue
        await page.select_option("#filter-state", "queued")
        await page.fill("#filter-queue", "mail")
        await page.click("#filters button[type=submit]")
        # Choosing the state alone already refreshes the list (queued tasks of every queue,
        # the report's included): wait for the list the two filters give, not for its first row.
        shown_js = "() => [...document.querySelectorAll('#tasks tbody tr')].map(r => +r.dataset.id)"
        deadline = asyncio.get_running_loop().time() + 10
        while (shown := await page.evaluate(shown_js)) != mails:
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        assert shown == mails
        await page.select_option("#filter-state", "scheduled")
        await page.wait_for_selector(f'#tasks tr[data-id="{later}"]')

        caplog.set_level(logging.WARNING, logger="outboxkit.dashboard")
        await _cross_site_attempt(browser, url, mails[0], caplog)
        assert _status(tasks_dsn, mails[0]) == TaskStatus.PENDING, "nothing done cross-site"

        await page.fill("#token", TOKEN)
        await page.click("#token-save")
        await page.fill("#filter-queue", "")
        async with running_worker(tasks, tasks_dsn, ["default", "reports"]):
            # cancel of a running task reaches its handler
            await asyncio.wait_for(report_started.wait(), 10)
            await page.select_option("#filter-state", "running")
            running = page.locator(f'#tasks tr[data-id="{report}"]')
            await running.wait_for()
            assert (await running.locator("td").nth(6).text_content() or "") != "", "lease holder"
            await running.locator("button.cancel").click()
            await wait_for(lambda: cancelled == [report], what="the handler saw the cancellation")
            assert _status(tasks_dsn, report) == TaskStatus.CANCELLED
            assert str(report) in dialogs[-1]

            # replay of the failed task makes the worker run it again, from its first attempt
            fixed.set()
            await page.select_option("#filter-state", "failed")
            await page.locator(f'#tasks tr[data-id="{invoice}"] button.replay').click()
            await wait_for(lambda: _status(tasks_dsn, invoice) is None, what="replayed and run")
            assert charges == [(invoice, 1), (invoice, 1)]

        # discard removes the cancelled task for good
        await page.select_option("#filter-state", "cancelled")
        await page.locator(f'#tasks tr[data-id="{report}"] button.discard').click()
        await wait_for(lambda: _status(tasks_dsn, report) is None, what="discarded")
        await page.wait_for_selector("#no-tasks:not([hidden])")
        assert _status(tasks_dsn, mails[0]) == TaskStatus.PENDING, "the others untouched"


async def test_without_a_task_table_the_api_says_how_to_create_it(db_dsn: str) -> None:
    """(The page's rendering of it: in the browser test above.)"""
    async with served(Dashboard(db_dsn)) as url, aiohttp.ClientSession() as s:
        async with s.get(f"{url}/api/tasks/overview") as resp:
            assert resp.status == 200
            assert "outboxkit migrate --tasks" in (await resp.json())["missing"]
        for path in ("/api/tasks?state=failed", "/api/tasks/1"):
            async with s.get(url + path) as resp:
                assert resp.status == 404
                assert "outboxkit migrate --tasks" in (await resp.json())["error"]
                assert resp.headers["X-Content-Type-Options"] == "nosniff"
        async with s.post(f"{url}/api/tasks/1/cancel") as resp:
            assert resp.status == 403, "read-only refuses before the table is looked at"


async def test_task_actions_need_the_token_and_refuse_what_does_not_apply(tasks_dsn: str) -> None:
    tasks = Tasks()
    tasks.handler("job")(lambda payload: None)
    task = _enqueue(tasks_dsn, tasks, "job", {"n": 1})

    async with served(Dashboard(tasks_dsn)) as url, aiohttp.ClientSession() as s:
        async with s.post(
            f"{url}/api/tasks/{task}/cancel", headers={"X-Outboxkit-Token": TOKEN}
        ) as resp:
            assert resp.status == 403 and "read-only" in (await resp.json())["error"]

    board = Dashboard(tasks_dsn, admin_token=TOKEN)
    async with served(board) as url:
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"X-Outboxkit-Token": "guess-" + "0" * 20}):
                async with s.post(f"{url}/api/tasks/{task}/cancel", headers=headers) as resp:
                    assert resp.status == 403
            token = {"X-Outboxkit-Token": TOKEN}
            for verb, says in (("replay", "only those"), ("discard", "cancel it first")):
                async with s.post(f"{url}/api/tasks/{task}/{verb}", headers=token) as resp:
                    assert resp.status == 409 and says in (await resp.json())["error"], verb
            for bad in ("²", "-1", "99999999999999999999", "1e3"):
                async with s.post(f"{url}/api/tasks/{bad}/cancel", headers=token) as resp:
                    assert resp.status == 400, bad
            async with s.get(f"{url}/api/tasks?state=stuck") as resp:
                assert resp.status == 400 and "queued" in await resp.text()
            async with s.get(f"{url}/api/tasks", params={"name": "x" * 201}) as resp:
                assert resp.status == 400
    assert _status(tasks_dsn, task) == TaskStatus.PENDING


async def _cross_site_attempt(
    browser: Any, url: str, task: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A page of another origin that knows the token (the worst case) tries to cancel ``task``.

    Its form POST reaches the dashboard (an action authenticated by a cookie, or by a token
    in the form, would run) and is refused; its fetch, which sends the token header, fails the
    browser's preflight (the dashboard allows no CORS) and never reaches the action.
    """

    async def attacker_page(_request: web.Request) -> web.Response:
        return _attacker_page(url, task)

    evil = web.Application()
    evil.router.add_get("/", attacker_page)
    runner = web.AppRunner(evil, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", free_port()).start()
    try:
        page = await browser.new_page()
        await page.goto(f"http://127.0.0.1:{runner.addresses[0][1]}/")
        await page.wait_for_function("window.fetchResult !== undefined")
        assert (await page.evaluate("window.fetchResult")).startswith("blocked")
        await wait_for(
            lambda: any("wrong admin token" in r.getMessage() for r in caplog.records),
            what="the cross-site form's POST reached the dashboard",
        )
        await page.close()
    finally:
        await runner.cleanup()


def _attacker_page(url: str, task: int) -> web.Response:
    """Another origin's page that knows the token (the worst case) and tries to cancel."""
    target = f"{url}/api/tasks/{task}/cancel"
    return web.Response(
        content_type="text/html",
        text=f"""<!doctype html><html><body>
<form id="f" method="POST" action="{target}" target="sink">
  <input name="X-Outboxkit-Token" value="{TOKEN}"></form>
<iframe name="sink"></iframe>
<script>
document.getElementById("f").submit();
fetch("{target}", {{method: "POST", headers: {{"X-Outboxkit-Token": "{TOKEN}"}}}})
  .then(r => {{ window.fetchResult = "status " + r.status; }},
        e => {{ window.fetchResult = "blocked: " + e; }});
</script></body></html>""",
    )


async def test_secrets_in_task_errors_and_tracebacks_are_masked(tasks_dsn: str) -> None:
    tasks = Tasks()
    tasks.handler("job")(lambda payload: None)
    task = _enqueue(tasks_dsn, tasks, "job")
    leak = "could not connect to postgresql://app:s3cr3t-pw@db.internal/shop"
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        conn.execute(
            f"UPDATE {TABLE} SET status = %s, last_error = %s, error_type = 'OperationalError',"
            f" traceback_excerpt = %s WHERE id = %s",
            (TaskStatus.FAILED, leak, f"Traceback ...\n  {leak}", task),
        )
    async with served(Dashboard(tasks_dsn)) as url, aiohttp.ClientSession() as s:
        for path in (f"/api/tasks/{task}", "/api/tasks?state=failed"):
            async with s.get(url + path) as resp:
                text = await resp.text()
                assert resp.status == 200 and "db.internal" in text, text
                assert "s3cr3t-pw" not in text, path


def test_the_command_starts_on_a_database_used_for_task_mode_only(empty_db_dsn: str) -> None:
    """Before: `outboxkit dashboard` refused to start without an outbox table (its start-up
    check, run here in-process: starting the command takes seconds on a loaded machine)."""
    from outboxkit.ops.cli.dashboard import _check_tables

    with pytest.raises(TableNotFoundError, match="outboxkit migrate"):
        _check_tables(empty_db_dsn, "outbox", TABLE)  # neither table: the outbox's message
    migrate_tasks(empty_db_dsn)
    _check_tables(empty_db_dsn, "outbox", TABLE)
    with pytest.raises(TableNotFoundError):
        _check_tables(empty_db_dsn, "outbox", "other_tasks")


async def test_a_task_whose_payload_does_not_decode_opens(tasks_dsn: str) -> None:
    """A payload nested 3 000 levels deep (inserted by SQL) opens as its text (was a 500)."""
    with psycopg.connect(tasks_dsn, autocommit=True) as conn:
        row = conn.execute(
            f"INSERT INTO {TABLE} (task_name, queue, payload) VALUES ('job', 'default', %s)"
            " RETURNING id",
            ("[" * 3000 + "]" * 3000,),
        ).fetchone()
    assert row is not None
    async with served(Dashboard(tasks_dsn)) as url, aiohttp.ClientSession() as s:
        async with s.get(f"{url}/api/tasks/{row[0]}") as resp:
            body = await resp.json()
            assert resp.status == 200, body
    assert body["payload"].startswith("[[[") and body["payload_kind"] == "text"


async def test_the_tasks_page_pauses_and_resumes_a_queue_with_the_token(
    tasks_dsn: str,
) -> None:
    tasks = Tasks()
    ran: list[str] = []

    @tasks.handler("job")
    async def job(payload: Any) -> None:
        ran.append(str(payload))

    hostile = "<img src=x onerror=window.__pwned=3>"
    mail = _enqueue(tasks_dsn, tasks, "job", "mail", queue="mail")
    _enqueue(tasks_dsn, tasks, "job", "hostile", queue=hostile)
    tasks.pause(tasks_dsn, hostile)

    board = Dashboard(tasks_dsn, admin_token=TOKEN, sample_interval=0.5)
    async with served(board) as url, chromium() as browser:
        async with aiohttp.ClientSession() as s:  # the API refuses without the token
            async with s.post(f"{url}/api/tasks/queues/mail/pause") as resp:
                assert resp.status == 403
        page = await browser.new_page(viewport={"width": 1400, "height": 1100})
        dialogs = accepting_dialogs(page)
        await page.goto(url + "/tasks")
        await page.wait_for_selector('#queues tr[data-queue="mail"]')
        shown = await page.eval_on_selector_all(
            "#queues tbody tr",
            "rows => rows.map(r => [...r.cells].slice(0, 4).map(c => c.textContent))",
        )
        assert sorted(shown) == sorted(
            [[hostile, "paused", "1", "0"], ["mail", "running", "1", "0"]]
        )
        assert await page.locator("#queues img").count() == 0
        assert await page.evaluate("window.__pwned") is None

        await page.fill("#token", TOKEN)
        await page.click("#token-save")
        await page.locator('#queues tr[data-queue="mail"] button.pause').click()
        await page.wait_for_selector('#queues tr[data-queue="mail"][data-paused="true"]')
        assert "mail" in dialogs[-1]
        async with running_worker(tasks, tasks_dsn, ["mail", hostile]):
            await asyncio.sleep(1.0)
            assert ran == [], "a paused queue's task ran"
            await page.locator('#queues tr[data-queue="mail"] button.resume').click()
            await wait_for(lambda: ran == ["mail"], what="the resumed queue's task ran")
        assert _status(tasks_dsn, mail) is None
        by = await page.text_content('#queues tr[data-queue="mail"] td:nth-child(6)') or ""
        assert by.startswith("dashboard (")


async def test_a_kept_result_and_progress_show_in_the_api_and_the_page(tasks_dsn: str) -> None:
    tasks = Tasks()

    @tasks.handler("report", keep_result=True)
    def report(payload: Any, ctx: TaskContext) -> dict[str, Any]:
        ctx.progress({"done": 3, "of": 3})
        return {"rows": 3, "note": "<b>bold</b>"}

    task = _enqueue(tasks_dsn, tasks, "report", {"id": 1})
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():  # waits for it, never runs
        waiting = tasks.enqueue(conn, "report", {"id": 2}, after=[task], delay=3600)
    async with running_worker(tasks, tasks_dsn, ["default"]):
        await wait_for(
            lambda: (r := tasks.result(tasks_dsn, task)) is not None and r.finished,
            what="the task finished",
        )
    async with served(Dashboard(tasks_dsn)) as url, chromium() as browser:
        async with aiohttp.ClientSession() as s, s.get(f"{url}/api/tasks/{task}") as resp:
            body = await resp.json()
        assert body["state"] == "done" and body["kept_until"] is not None
        assert json.loads(body["result"]) == {"rows": 3, "note": "<b>bold</b>"}
        assert json.loads(body["progress"]) == {"done": 3, "of": 3}
        assert body["upstream"] == [] and body["downstream"] == [waiting]
        page = await browser.new_page(viewport={"width": 1400, "height": 1100})
        await page.goto(url + "/tasks")
        await page.select_option("#filter-state", "done")
        await page.locator(f'tr[data-id="{task}"] button.view').click()
        await page.wait_for_selector("#detail:not([hidden])")
        assert await page.text_content("#detail-result") == body["result"]  # as text, escaped
        assert await page.locator("#detail-result b").count() == 0
        fields = await page.eval_on_selector_all(
            "#detail-fields tbody tr", "rows => rows.map(r => r.cells[0].textContent)"
        )
        assert "progress" in fields and "result kept until" in fields
        assert "waited for by (downstream)" in fields
