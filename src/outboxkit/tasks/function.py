"""What ``@tasks.handler`` returns: the handler itself, plus an enqueue typed by its payload.

``generate.enqueue(conn, Report(...))`` instead of ``tasks.enqueue(conn, "report.generate",
{...})``: the task's name cannot be misspelt and mypy checks the payload at the call site
(the payload type is read from the handler's first parameter). Calling the object calls the
function, so tests and other callers use it as before; the string form stays."""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

if TYPE_CHECKING:
    from outboxkit.drivers import AsyncConnection, SyncConnection
    from outboxkit.tasks.context import TaskContext
    from outboxkit.tasks.registry import Tasks

P = TypeVar("P")
R = TypeVar("R")


class TaskFunction(Generic[P, R]):
    """A registered handler: call it as the function; ``.enqueue`` / ``.aenqueue`` its task."""

    def __init__(self, tasks: Tasks, name: str, fn: Callable[..., R]) -> None:
        self.tasks = tasks
        #: The task's name (what ``tasks.enqueue`` takes as a string).
        self.name = name
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<task {self.name!r}: {self.fn!r}>"

    def enqueue(
        self,
        conn: SyncConnection,
        payload: P,
        *,
        delay: float | dt.timedelta | None = None,
        run_at: dt.datetime | None = None,
        unique_key: str | None = None,
        priority: int = 0,
        queue: str = "default",
        key: str | None = None,
        max_attempts: int | None = None,
        after: Sequence[int] | None = None,
        after_failure: Literal["cancel", "run"] = "cancel",
    ) -> int | None:
        """:meth:`Tasks.enqueue` of this task: its id, or None for a skipped duplicate."""
        return self.tasks.enqueue(
            conn, self.name, payload, delay=delay, run_at=run_at, unique_key=unique_key,
            priority=priority, queue=queue, key=key, max_attempts=max_attempts, after=after,
            after_failure=after_failure,
        )  # fmt: skip

    async def aenqueue(
        self,
        conn: AsyncConnection,
        payload: P,
        *,
        delay: float | dt.timedelta | None = None,
        run_at: dt.datetime | None = None,
        unique_key: str | None = None,
        priority: int = 0,
        queue: str = "default",
        key: str | None = None,
        max_attempts: int | None = None,
        after: Sequence[int] | None = None,
        after_failure: Literal["cancel", "run"] = "cancel",
    ) -> int | None:
        """:meth:`Tasks.aenqueue` of this task."""
        return await self.tasks.aenqueue(
            conn, self.name, payload, delay=delay, run_at=run_at, unique_key=unique_key,
            priority=priority, queue=queue, key=key, max_attempts=max_attempts, after=after,
            after_failure=after_failure,
        )  # fmt: skip


class Registrar:
    """``@tasks.handler(name)``'s decorator: typed by the handler's payload parameter."""

    def __init__(self, register: Callable[[Callable[..., Any]], TaskFunction[Any, Any]]) -> None:
        self._register = register

    @overload
    def __call__(self, fn: Callable[[P], R]) -> TaskFunction[P, R]: ...

    @overload
    def __call__(self, fn: Callable[[P, TaskContext], R]) -> TaskFunction[P, R]: ...

    def __call__(self, fn: Callable[..., R]) -> TaskFunction[Any, R]:
        return self._register(fn)
