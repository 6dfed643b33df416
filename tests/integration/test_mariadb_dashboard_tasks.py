"""The dashboard's Tasks page on the private mariadbd, over HTTP: rows made by real enqueues
from PyMySQL and a real Worker (a failed task, a kept result, queued, scheduled and keyed
ones), read through the backend's TaskAdmin port exactly as on PostgreSQL; replay, cancel,
discard, pause and resume with the admin token, each effect read back from the table.

Before, a mysql:// URL got the one line of ``cannot["task_admin"]`` on every path (the page
read PostgreSQL's task table only). The page's rendering and escaping are the same static
files on both databases: test_dashboard_tasks.py drives them in Chromium against PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pymysql
import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import TableNotFoundError
from outboxkit.ops.dashboard import Dashboard
from outboxkit.queue.tasks import TaskStatus
from outboxkit.tasks import TaskContext, Tasks
from tests.integration.test_dashboard import served
from tests.integration.test_dashboard_tasks import running_worker
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import mariadb_execute, new_database, own_database
from tests.support.relaying import wait_for

TABLE = "outboxkit_tasks"
TOKEN = "t0ken-" + uuid.uuid4().hex
AUTH = {"X-Outboxkit-Token": TOKEN}
HOSTILE_ERROR = '<img src=x onerror="window.__pwned = 2"> card declined'

tasks = Tasks()
mails: list[str] = []


@tasks.handler("invoice.charge", max_attempts=1)
def charge(payload: Any) -> None:
    raise RuntimeError(HOSTILE_ERROR)


@tasks.handler("report", keep_result=True)
def report(payload: Any, ctx: TaskContext) -> dict[str, Any]:
    ctx.progress({"done": 3, "of": 3})
    return {"rows": 3, "note": "<b>bold</b>"}


@tasks.handler("mail.send")
def send(payload: Any) -> None:
    mails.append(str(payload["to"]))


@pytest.fixture
def tasks_url(mariadb_server: MariaDB) -> Iterator[str]:
    url = new_database(mariadb_server)
    migrate(url, kind="tasks", table=TABLE)
    yield url


def _enqueue(url: str, name: str, payload: Any, **options: Any) -> int:
    conn = pymysql.connect(**connect_args(url))
    try:
        conn.begin()
        task_id = tasks.enqueue(conn, name, payload, **options)
        conn.commit()
    finally:
        conn.close()
    assert task_id is not None
    return task_id


def _status(url: str, task_id: int) -> int | None:
    rows = mariadb_execute(url, f"SELECT status FROM {TABLE} WHERE id = %s", (task_id,))
    return int(rows[0][0]) if rows else None


async def test_the_tasks_page_on_mariadb_lists_shows_and_acts_through_the_task_port(
    tasks_url: str,
) -> None:
    url = tasks_url
    invoice = _enqueue(url, "invoice.charge", {"amount": 42})
    kept = _enqueue(url, "report", {"month": 11})
    async with running_worker(tasks, url, ["default"]):
        await wait_for(
            lambda: (
                _status(url, invoice) == TaskStatus.FAILED and _status(url, kept) == TaskStatus.DONE
            ),
            what="the invoice failed and the report done",
        )
    queued = [_enqueue(url, "mail.send", {"to": f"u{i}"}, queue="mail") for i in (1, 2)]
    later = _enqueue(url, "mail.send", {"to": "u3"}, queue="mail", delay=3600)

    board = Dashboard(url, admin_token=TOKEN, sample_interval=60)
    async with served(board) as base, aiohttp.ClientSession() as s:

        async def get(path: str, **params: str) -> Any:
            async with s.get(base + path, params=params) as resp:
                assert resp.status == 200, (path, await resp.text())
                return await resp.json()

        async def post(path: str, headers: dict[str, str] | None = AUTH) -> tuple[int, Any]:
            async with s.post(base + path, headers=headers or {}) as resp:
                return resp.status, await resp.json()

        async with s.get(base + "/tasks") as resp:  # the page itself
            assert resp.status == 200 and "<html" in (await resp.text()).lower()
        overview = await get("/api/tasks/overview")
        assert "missing" not in overview and overview["read_only"] is False
        assert overview["totals"] == {"queued": 2, "scheduled": 1, "running": 0, "failed": 1}
        by_name = {n["task_name"]: n for n in overview["names"]}
        assert (by_name["mail.send"]["queued"], by_name["mail.send"]["scheduled"]) == (2, 1)
        assert by_name["mail.send"]["oldest_queued_age_s"] >= 0

        [failed] = await get("/api/tasks", state="failed")
        assert (failed["id"], failed["state"], failed["status"]) == (invoice, "failed", "failed")
        assert HOSTILE_ERROR in failed["last_error"]  # as text: the page sets textContent
        assert [r["id"] for r in await get("/api/tasks", state="queued")] == queued
        assert [r["id"] for r in await get("/api/tasks", state="scheduled")] == [later]
        assert [r["id"] for r in await get("/api/tasks", state="done")] == [kept]
        assert [r["id"] for r in await get("/api/tasks", queue="mail", limit="1")] == queued[:1]
        assert await get("/api/tasks", name="no.such.task") == []

        detail = await get(f"/api/tasks/{invoice}")
        assert json.loads(detail["payload"]) == {"amount": 42} and detail["payload_kind"] == "json"
        assert "RuntimeError" in detail["traceback_excerpt"] and "claim_token" not in detail
        detail = await get(f"/api/tasks/{kept}")
        assert detail["state"] == "done" and detail["kept_until"] is not None
        assert json.loads(detail["result"]) == {"rows": 3, "note": "<b>bold</b>"}
        assert json.loads(detail["progress"]) == {"done": 3, "of": 3}
        async with s.get(f"{base}/api/tasks/999999") as resp:
            assert resp.status == 404 and "no task 999999" in (await resp.json())["error"]

        # actions: the token first, then what does not apply, then each one's effect
        assert (await post(f"/api/tasks/{invoice}/replay", None))[0] == 403
        status, body = await post(f"/api/tasks/{queued[0]}/replay")
        assert status == 409 and "only those" in body["error"]
        assert await post(f"/api/tasks/{invoice}/replay") == (200, {"replay": invoice})
        assert _status(url, invoice) == TaskStatus.PENDING
        assert await post(f"/api/tasks/{later}/cancel") == (200, {"cancel": later})
        assert _status(url, later) == TaskStatus.CANCELLED
        assert await post(f"/api/tasks/{later}/discard") == (200, {"discard": later})
        assert _status(url, later) is None

        # pause the mail queue from the page: a worker on it runs nothing until resumed
        assert await post("/api/tasks/queues/mail/pause") == (
            200,
            {"pause": "mail", "changed": True},
        )
        [mail] = [q for q in await get("/api/tasks/queues") if q["queue"] == "mail"]
        assert mail["paused"] is True and mail["queued"] == 2
        assert str(mail["changed_by"]).startswith("dashboard (")
        async with running_worker(tasks, url, ["mail"]):
            await asyncio.sleep(0.5)
            assert mails == [], "a paused queue's task ran"
            status, body = await post("/api/tasks/queues/mail/resume")
            assert (status, body["changed"]) == (200, True)
            await wait_for(lambda: sorted(mails) == ["u1", "u2"], what="the resumed queue ran")


async def test_without_a_task_table_the_page_says_how_to_create_it_on_mariadb(
    mariadb_server: MariaDB,
) -> None:
    """And `outboxkit dashboard`'s start-up check (in-process) accepts a MariaDB database used
    for task mode only, as on PostgreSQL."""
    from outboxkit.ops.cli.dashboard import _check_tables

    with own_database(mariadb_server) as url:
        async with served(Dashboard(url, sample_interval=60)) as base, aiohttp.ClientSession() as s:
            async with s.get(f"{base}/api/tasks/overview") as resp:
                missing = (await resp.json())["missing"]
                assert resp.status == 200 and "outboxkit migrate --tasks --dsn mysql://" in missing
            async with s.get(f"{base}/api/tasks?state=failed") as resp:
                assert resp.status == 404 and "outboxkit migrate --tasks" in await resp.text()
        with pytest.raises(TableNotFoundError, match="outboxkit migrate"):
            _check_tables(url, "outbox", TABLE)  # neither table: the outbox's message
        migrate(url, kind="tasks", table=TABLE)
        _check_tables(url, "outbox", TABLE)
