"""Atomic Celery dispatch: ``send_task`` writes the task in the caller's transaction.

``celery_app.send_task(...)`` (or ``transaction.on_commit(lambda: task.delay(...))``) is a
dual write: the process can die between the COMMIT and the publish, and the task is
lost. ``send_task`` here appends the task to the outbox inside the open transaction
instead; ``outboxkit relay --broker 'celery+amqp://...'`` (or ``celery+redis://...``)
publishes it in Celery's message protocol 2 after the COMMIT, to the workers a team
already runs. At least once, as Celery itself: a relay killed after the broker took a
task and before it recorded that may publish it again, so tasks should be idempotent
by their task id (docs/celery.md).

Celery itself is not needed to write: the message is built from plain JSON.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from outboxkit.drivers import AsyncConnection, SyncConnection
from outboxkit.errors import InvalidEventError
from outboxkit.events import Event, new_event_id
from outboxkit.wire import celery as wire
from outboxkit.write.outbox import Outbox

__all__ = ["DEFAULT_QUEUE", "asend_task", "send_task", "task_event"]

#: Celery's ``task_default_queue``.
DEFAULT_QUEUE = "celery"
# Celery's argsrepr_maxsize / kwargsrepr_maxsize: the repr shown by Flower and the logs.
_REPR_MAX = 1024

_default_outbox: Outbox | None = None


def task_event(
    name: str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    queue: str = DEFAULT_QUEUE,
    countdown: float | None = None,
    eta: dt.datetime | None = None,
    task_id: str | None = None,
) -> Event:
    """The outbox event of one Celery task message, checked now (before any COMMIT).

    The task name is the event type, the queue its topic, the body ``[args, kwargs,
    embed]`` its JSON payload; the task id and ETA ride as ``celery-*`` headers.
    ``countdown`` (seconds from now) or ``eta`` (an aware datetime) become the
    message's ``eta``: the worker holds the task until then, as for ``apply_async``.
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidEventError("send_task needs the task's registered name, e.g. 'proj.tasks.add'")
    if not isinstance(queue, str) or not queue.strip():
        raise InvalidEventError("send_task queue= must be a non-empty queue name")
    if args is None:
        args = ()
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise InvalidEventError(
            f"send_task args= must be a list or tuple, got {type(args).__name__}"
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidEventError("send_task kwargs= must be a mapping with string keys")
    when = _eta(countdown, eta)
    if task_id is None:
        event_id = new_event_id()  # the task id too: one id in the outbox and the worker
        task_id = str(event_id)
    elif not isinstance(task_id, str) or not task_id:
        raise InvalidEventError("send_task task_id= must be a non-empty string")
    else:
        try:
            event_id = uuid.UUID(task_id)
        except ValueError:  # Celery takes any string; the event gets an id of its own
            event_id = new_event_id()
    headers = {
        wire.TASK_ID: task_id,
        wire.ARGSREPR: repr(tuple(args))[:_REPR_MAX],
        wire.KWARGSREPR: repr(dict(kwargs))[:_REPR_MAX],
        wire.ORIGIN: f"gen{os.getpid()}@{socket.gethostname()}",
    }
    if when is not None:
        headers[wire.ETA] = when.isoformat()
    return Event(
        topic=queue,
        event_type=name,
        payload=[list(args), dict(kwargs), _EMBED],
        headers=headers,
        event_id=event_id,
    )


def send_task(
    conn: SyncConnection,
    name: str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    queue: str = DEFAULT_QUEUE,
    countdown: float | None = None,
    eta: dt.datetime | None = None,
    task_id: str | None = None,
    outbox: Outbox | None = None,
) -> str:
    """Write Celery task ``name`` in ``conn``'s open transaction; return its task id.

    ``conn`` is any connection the outbox write takes (psycopg, SQLAlchemy, psycopg2,
    PyMySQL, mysqlclient: the outbox follows the connection's database), inside a transaction: a
    rollback takes the task with it. ``AsyncResult(task_id)`` follows it once a worker
    runs it.
    """
    event = task_event(
        name, args, kwargs, queue=queue, countdown=countdown, eta=eta, task_id=task_id
    )
    (outbox or _outbox()).put(conn, event)
    return event.headers[wire.TASK_ID]


async def asend_task(
    conn: AsyncConnection,
    name: str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    queue: str = DEFAULT_QUEUE,
    countdown: float | None = None,
    eta: dt.datetime | None = None,
    task_id: str | None = None,
    outbox: Outbox | None = None,
) -> str:
    """:func:`send_task` on an async connection (psycopg async, asyncpg, SQLAlchemy async)."""
    event = task_event(
        name, args, kwargs, queue=queue, countdown=countdown, eta=eta, task_id=task_id
    )
    await (outbox or _outbox()).aput(conn, event)
    return event.headers[wire.TASK_ID]


_EMBED: dict[str, Any] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def _eta(countdown: float | None, eta: dt.datetime | None) -> dt.datetime | None:
    if countdown is not None and eta is not None:
        raise InvalidEventError("send_task takes countdown= or eta=, not both")
    if countdown is not None:
        if isinstance(countdown, bool) or not isinstance(countdown, int | float):
            raise InvalidEventError("send_task countdown= must be a number of seconds")
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=countdown)
    if eta is not None:
        if not isinstance(eta, dt.datetime) or eta.utcoffset() is None:
            raise InvalidEventError(
                "send_task eta= must be an aware datetime (e.g. with tzinfo=datetime.UTC):"
                " a naive one would be read in the workers' timezone"
            )
        return eta
    return None


def _outbox() -> Outbox:
    """The default outbox (table ``outbox``), made once."""
    global _default_outbox
    if _default_outbox is None:
        _default_outbox = Outbox()
    return _default_outbox
