"""The dashboard's Tasks page: task mode's table by state, one task's detail, and its actions.

Every read and action is a function of the database's TaskAdmin port (backends/ports.py), the
ones `outboxkit tasks list | show | replay | cancel | discard | queues | pause | resume` run, on
the dashboard's kept connections: no SQL here, and the same page on PostgreSQL and MariaDB."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
from aiohttp import web

from outboxkit._redact import redact
from outboxkit.backends import backend_for
from outboxkit.backends.ports import TaskAdmin
from outboxkit.errors import SchemaError, StoreError
from outboxkit.ops.dashboard import (
    STATIC,
    Dashboard,
    _json,
    _limit,
    _payload_text,
    _refusal,
    _row_id,
    log,
)
from outboxkit.queue.tasks import TaskStatus
from outboxkit.tasks.unsupported import missing

#: The page's states: the stored status and, for pending tasks, whether they are due now.
STATES: dict[str, tuple[TaskStatus | None, bool | None]] = {
    "queued": (TaskStatus.PENDING, True),
    "scheduled": (TaskStatus.PENDING, False),
    "waiting": (TaskStatus.WAITING, None),  # for its upstream tasks (after=)
    "running": (TaskStatus.RUNNING, None),
    "failed": (TaskStatus.FAILED, None),
    "cancelled": (TaskStatus.CANCELLED, None),
    "done": (TaskStatus.DONE, None),  # kept only by workers run with --retention keep
    "all": (None, None),
}
#: Longest task name or queue accepted in a filter (longer ones match nothing anyway).
MAX_FILTER_CHARS = 200
_ID_TEXT = "task ids are the task table's row ids"
#: Columns the detail leaves out: the payload comes as text, the claim token is the
#: running attempt's fencing token and nobody's business.
_HIDDEN = ("payload", "payload_json", "claim_token", "result", "progress")


#: The same functions as `outboxkit tasks replay | cancel | discard`, and why one changes nothing.
_ACTIONS: tuple[tuple[str, Callable[[TaskAdmin], Callable[..., list[int]]], str], ...] = (
    ("replay", lambda ops: lambda *a: ops.replay_tasks_reporting(*a)[0],
     "is not failed or cancelled (any more, or at all): only those can be replayed"),
    ("cancel", lambda ops: ops.cancel_tasks,
     "is not queued, scheduled or running (any more, or at all): nothing to cancel"),
    ("discard", lambda ops: ops.discard_tasks,
     "is not failed or cancelled (any more, or at all): cancel it first to discard it"),
)  # fmt: skip
#: What a task function raises when the database fails a statement: PostgreSQL's driver error
#: as it is, or a backend's StoreError (MariaDB's functions wrap PyMySQL's so).
_DB_ERRORS = (psycopg.Error, StoreError)


def _state(status: int, due: bool) -> str:
    if status == TaskStatus.PENDING:
        return "queued" if due else "scheduled"
    return TaskStatus(status).name.lower()


def _listed(row: dict[str, Any]) -> dict[str, Any]:
    row["state"] = _state(row["status"], bool(row.pop("due")))
    row["status"] = TaskStatus(row["status"]).name.lower()
    if row.get("last_error"):
        row["last_error"] = redact(str(row["last_error"]))
    return row


def _detail(row: dict[str, Any]) -> dict[str, Any]:
    text, kind, truncated = _payload_text((row.get("payload_json") or "null").encode())
    due = row["available_at"] <= dt.datetime.now(dt.UTC)
    shown = {k: v for k, v in row.items() if k not in _HIDDEN}
    for key in ("last_error", "traceback_excerpt"):
        if shown.get(key):
            shown[key] = redact(str(shown[key]))
    # The result and progress come as JSON text (show_task), cut as the payload is.
    result = row.get("result")
    value, _kind, value_truncated = _payload_text((result or "null").encode())
    shown.update(
        state=_state(row["status"], due),
        status=TaskStatus(row["status"]).name.lower(),
        payload=text,
        payload_kind=kind,
        payload_truncated=truncated,
        result=None if result is None else value,
        result_truncated=value_truncated,
        progress=row.get("progress"),
        kept_until=row.get("keep_until"),
        upstream=list(row.get("upstream") or []),
        downstream=list(row.get("downstream") or []),
    )
    return shown


def _filter(request: web.Request, name: str) -> str | None:
    value = request.query.get(name, "").strip()
    if len(value) > MAX_FILTER_CHARS:
        raise web.HTTPBadRequest(text=f"{name} is at most {MAX_FILTER_CHARS} characters")
    return value or None


def add_task_routes(app: web.Application, dashboard: Dashboard) -> None:
    """The Tasks page and its JSON API under /api/tasks."""
    table = dashboard.tasks_table
    unsupported = missing(dashboard.dsn)  # a database without task mode: the page says why
    ops = None if unsupported else backend_for(dashboard.dsn).task_admin()

    async def run(
        pick: Callable[[TaskAdmin], Callable[..., Any]], *args: Any, **kwargs: Any
    ) -> Any:
        """The port's ``pick(port)(connection, table, ...)``; a database without task mode, a
        missing table or a database error as JSON."""
        if ops is None:
            raise _answer(web.HTTPNotFound, {"error": unsupported, "missing": True})
        try:
            return await dashboard.connections.run(pick(ops), table, *args, **kwargs)
        except SchemaError as exc:
            raise _answer(web.HTTPNotFound, {"error": str(exc), "missing": True}) from None
        except _DB_ERRORS as exc:
            raise _answer(web.HTTPServiceUnavailable, {"error": _db_error(exc)}) from None

    async def page(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "tasks.html")

    async def overview(_request: web.Request) -> web.Response:
        base = {"table": table, "read_only": dashboard.admin_token is None}
        if ops is None:
            return _json({**base, "missing": unsupported})
        try:
            gauges = await dashboard.connections.run(ops.task_gauges, table)
        except SchemaError as exc:  # says `outboxkit migrate --tasks ...`
            return _json({**base, "missing": str(exc)})
        except _DB_ERRORS as exc:
            return _json({**base, "error": _db_error(exc)})
        names = [
            {"task_name": name, "queued": q, "scheduled": s, "running": r, "failed": f,
             "oldest_queued_age_s": age}
            for name, q, s, r, f, age in sorted(gauges)
        ]  # fmt: skip
        totals = {k: sum(n[k] for n in names) for k in ("queued", "scheduled", "running", "failed")}
        ages = [n["oldest_queued_age_s"] for n in names if n["oldest_queued_age_s"] is not None]
        return _json(
            {
                **base,
                "names": names,
                "totals": totals,
                "oldest_queued_age_s": max(ages, default=None),
            }
        )

    async def listing(request: web.Request) -> web.Response:
        state = request.query.get("state", "all")
        if state not in STATES:
            raise web.HTTPBadRequest(text=f"state is one of: {', '.join(STATES)}")
        status, due = STATES[state]
        rows = await run(
            lambda port: port.list_tasks,
            status=status,
            due=due,
            name=_filter(request, "name"),
            queue=_filter(request, "queue"),
            limit=_limit(request),
        )
        return _json([_listed(row) for row in rows])

    async def detail(request: web.Request) -> web.Response:
        task_id = _row_id(request, _ID_TEXT)
        row = await run(lambda port: port.show_task, task_id)
        if row is None:
            return _json({"error": f"no task {task_id} (finished and deleted, or discarded)"}, 404)
        return _json(_detail(row))

    def action(
        verb: str, run_it: Callable[[TaskAdmin], Callable[..., list[int]]], refused: str
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            task_id = _row_id(request, _ID_TEXT)
            denied = _refusal(dashboard, request, f"{verb} of task {task_id}")
            if denied is not None:
                return denied
            changed: Sequence[int] = await run(run_it, [task_id])
            log.warning(
                "dashboard: %s of task %d by %s: %d task(s) changed",
                verb,
                task_id,
                request.remote,
                len(changed),
                extra={"action": f"task {verb}", "task_id": task_id, "changed": len(changed)},
            )
            if not changed:
                return _json({"error": f"task {task_id} {refused}"}, 409)
            return _json({verb: task_id})

        return handler

    async def queues(_request: web.Request) -> web.Response:
        rows = await run(lambda port: port.queue_states)
        return _json(
            [{**q, "changed_at": q["changed_at"].isoformat() if q["changed_at"] else None}
             for q in rows]
        )  # fmt: skip

    def queue_action(verb: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        def switch(port: TaskAdmin) -> Callable[..., bool]:
            return port.pause_queue if verb == "pause" else port.resume_queue

        async def handler(request: web.Request) -> web.Response:
            queue = request.match_info["queue"]
            if not queue or len(queue) > MAX_FILTER_CHARS:
                return _json({"error": f"a queue name is 1 to {MAX_FILTER_CHARS} characters"}, 400)
            denied = _refusal(dashboard, request, f"{verb} of queue {queue}")
            if denied is not None:
                return denied
            changed = await run(switch, queue, by=f"dashboard ({request.remote})")
            log.warning(
                "dashboard: %s of queue %s by %s%s", verb, queue, request.remote,
                "" if changed else " (no change)",
                extra={"action": f"queue {verb}", "queue": queue, "changed": bool(changed)},
            )  # fmt: skip
            return _json({verb: queue, "changed": bool(changed)})

        return handler

    app.router.add_get("/tasks", page)
    app.router.add_get("/api/tasks/overview", overview)
    app.router.add_get("/api/tasks/queues", queues)
    app.router.add_post("/api/tasks/queues/{queue}/pause", queue_action("pause"))
    app.router.add_post("/api/tasks/queues/{queue}/resume", queue_action("resume"))
    app.router.add_get("/api/tasks", listing)
    app.router.add_get("/api/tasks/{id}", detail)
    for verb, run_it, refused in _ACTIONS:
        app.router.add_post(f"/api/tasks/{{id}}/{verb}", action(verb, run_it, refused))


def _answer(kind: type[web.HTTPException], body: dict[str, Any]) -> web.HTTPException:
    return kind(text=json.dumps(body), content_type="application/json")


def _db_error(exc: Exception) -> str:
    return "reading the task table failed: " + redact(f"{type(exc).__name__}: {exc}")[:500]
