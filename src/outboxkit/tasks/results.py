"""A task's outcome as its enqueuer reads it (``Tasks.result`` / ``wait``), and the handler's
return value as JSON (stored by the fenced completion when its handler keeps results).

The value is encoded as a payload is (pydantic models, dataclasses, ``Decimal``, ``UUID``,
``datetime``; orjson), refused past :data:`MAX_RESULT_BYTES` or where JSON cannot hold it
(NaN, a NUL character): the attempt fails with an error that says so, nothing half-stored.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import math
from typing import Any, Literal

import orjson

from outboxkit.errors import ResultError

__all__ = ["MAX_RESULT_BYTES", "ResultError", "TaskError", "TaskResult", "encode_result"]

#: A result's JSON text may not be larger (as a payload's: a table row, not a blob store).
MAX_RESULT_BYTES = 1024 * 1024

Status = Literal["queued", "scheduled", "waiting", "running", "done", "failed", "cancelled"]
#: The states a task does not leave by itself.
FINISHED: frozenset[str] = frozenset(("done", "failed", "cancelled"))


@dataclasses.dataclass(frozen=True, slots=True)
class TaskError:
    """Why a task's last attempt failed: the exception's type, message and traceback tail."""

    type: str | None
    message: str | None
    traceback: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class TaskResult:
    """One task as its enqueuer sees it.

    ``status``: queued (due), scheduled (not yet due), waiting (for its upstream tasks,
    ``after=``, or its key's turn), running, done, failed or cancelled.
    ``value``: the handler's return value as JSON (dicts, lists, numbers, strings), when its
    handler keeps results. ``error``: the last failure (also of a task that was retried and
    is queued again). ``progress``: the last ``ctx.progress()`` the task reported.
    """

    id: int
    name: str
    status: Status
    value: Any
    error: TaskError | None
    attempts: int
    progress: Any
    #: None only for an upstream task that is gone (done, its row deleted).
    enqueued_at: dt.datetime | None
    started_at: dt.datetime | None
    finished_at: dt.datetime | None

    @property
    def finished(self) -> bool:
        """Done, failed or cancelled: the task will not run again by itself."""
        return self.status in FINISHED

    @property
    def ok(self) -> bool:
        return self.status == "done"


def encode_result(task_name: str, value: Any) -> str:
    """``value`` as JSON text, or :class:`ResultError` saying why it cannot be stored."""
    try:
        text = orjson.dumps(value, default=_default).decode()
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise ResultError(
            f"the return value of task {task_name!r} is not JSON: {exc} (return a pydantic"
            " model, a dataclass, or dicts, lists, numbers and strings)"
        ) from None
    if "null" in text or "\\u0000" in text:
        problem = unstorable(value, "the return value")
        if problem is not None:
            raise ResultError(f"{problem} of task {task_name!r}")
    if len(text) > MAX_RESULT_BYTES:
        raise ResultError(
            f"the return value of task {task_name!r} is {len(text)} bytes of JSON, over the"
            f" {MAX_RESULT_BYTES} limit: store the data elsewhere and return its id"
        )
    return text


def _default(value: Any) -> Any:
    """What orjson does not encode itself: pydantic models, Decimals, sets."""
    dump = getattr(value, "model_dump", None)
    if dump is not None:
        return dump(mode="json")
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    raise TypeError(f"type {type(value).__name__} is not JSON serializable")


def unstorable(value: Any, path: str) -> str | None:
    """The first value JSON in PostgreSQL cannot hold as given (a non-finite float, a NUL)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"{path} is {value!r} (JSON has no NaN or infinity; orjson would store null)"
    elif isinstance(value, str):
        if "\x00" in value:
            return f"{path} contains a NUL character (PostgreSQL's jsonb cannot store it)"
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and "\x00" in k:
                return f"a key of {path} contains a NUL character (jsonb cannot store it)"
            found = unstorable(v, f"{path}[{k!r}]")
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for n, item in enumerate(value):
            found = unstorable(item, f"{path}[{n}]")
            if found is not None:
                return found
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        return unstorable(dataclasses.asdict(value), path)
    return None


_STATUS: dict[int, Status] = {
    1: "running", 2: "done", 3: "failed", 4: "cancelled", 5: "waiting",
}  # fmt: skip


def dependency_from_row(row: dict[str, Any]) -> TaskResult:
    """A ``READ_DEPENDENCIES`` row: an upstream task, or, where its row is gone (done and
    deleted: its handler keeps no result), a done one with no value."""
    if row["id"] is None:
        return TaskResult(
            id=int(row["after_id"]), name="", status="done", value=None, error=None,
            attempts=0, progress=None, enqueued_at=None, started_at=None, finished_at=None,
        )  # fmt: skip
    return result_from_row(row)


def result_from_row(row: dict[str, Any]) -> TaskResult:
    """A ``READ_RESULT`` row (backends/postgres/tasks_sql.py) as a :class:`TaskResult`."""
    code = int(row["status"])
    status: Status = (
        _STATUS[code] if code in _STATUS else ("scheduled" if row["later"] else "queued")
    )
    error = None
    if row["last_error"] is not None or row["error_type"] is not None:
        error = TaskError(row["error_type"], row["last_error"], row["traceback_excerpt"])
    return TaskResult(
        id=int(row["id"]),
        name=str(row["task_name"]),
        status=status,
        value=row["result"],
        error=error,
        attempts=int(row["attempts"]),
        progress=row["progress"],
        enqueued_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
    )
