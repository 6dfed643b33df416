"""Task lifecycle as outbox events (opt-in per task type: ``@tasks.handler(..., events=topic)``).

A completed, failed (to be retried) or dead-lettered attempt becomes an outbox event written
in the same transaction as the task's state change: the settle's (each backend's task store runs
this hook inside it) or the handler's own ``ctx.transaction()``. Downstream systems learn of it
through the relay, durably, exactly when the change committed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from outboxkit.backends import backend_for
from outboxkit.backends.ports import Backend
from outboxkit.events import Event
from outboxkit.queue.store import Decision, Verdict
from outboxkit.queue.tasks import ClaimedTask
from outboxkit.tasks.registry import Tasks
from outboxkit.write.outbox import Outbox

_KINDS = {Verdict.DONE: "completed", Verdict.RETRY: "failed", Verdict.DEAD: "dead_lettered"}


def lifecycle_event(task: ClaimedTask, kind: str, topic: str, error: str | None = None) -> Event:
    """One state change as an event: task.completed, task.failed or task.dead_lettered."""
    body = {
        "task_id": task.id,
        "task_name": task.task_name,
        "queue": task.queue,
        "attempt": task.attempt,
        "error": error,
        "error_type": task.error_type if error is not None else None,
    }
    return Event(
        topic=topic,
        event_type=f"task.{kind}",
        payload=orjson.dumps(body),
        key=task.key,
        aggregate_type="task",
        aggregate_id=str(task.id),
    )


def _checked(event: object) -> Event:
    assert isinstance(event, Event)
    return event


class LifecycleEvents:
    """The settle hook: the events of the settled tasks whose type opted in, as one INSERT
    in the outbox table of the worker's database (``backend``'s: PostgreSQL's by default),
    the statement ``outbox.put_many`` sends there."""

    def __init__(self, tasks: Tasks, outbox: Outbox, backend: Backend | None = None) -> None:
        self.tasks = tasks
        writer = outbox._writer_for(backend or backend_for("postgresql://"))
        self.storage = writer.storage

    def wanted(self) -> bool:
        return any(t.events is not None for t in self.tasks.types.values())

    def __call__(
        self, settled: Sequence[tuple[ClaimedTask, Decision]]
    ) -> tuple[str, Sequence[Any]] | None:
        events = []
        for task, decision in settled:
            task_type = self.tasks.types.get(task.task_name)
            kind = _KINDS.get(decision.verdict)
            if task_type is None or task_type.events is None or kind is None:
                continue
            events.append(lifecycle_event(task, kind, task_type.events, decision.error))
        prepared = self.storage.many(events, _checked) if events else None
        if prepared is None:
            return None
        statement, params = prepared
        return statement.text, params
