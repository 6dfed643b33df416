"""Task mode: the database as a job queue, with handlers run straight from the table.

``tasks = Tasks()``; ``@tasks.handler("report.generate")``; ``tasks.enqueue(conn, name,
payload)`` in the caller's transaction; ``outboxkit worker --app module:tasks`` runs them
(the queue core's claim loop with a handler sink). docs/tasks.md.
"""

from outboxkit.tasks.context import TaskContext
from outboxkit.tasks.errors import InvalidTaskError, LeaseLost, TaskNotFound
from outboxkit.tasks.function import TaskFunction
from outboxkit.tasks.migrate import migrate_tasks
from outboxkit.tasks.outcomes import Fail, Retry, Snooze
from outboxkit.tasks.registry import EnqueuedTask, Tasks
from outboxkit.tasks.results import ResultError, TaskError, TaskResult
from outboxkit.tasks.worker import Worker

__all__ = [
    "EnqueuedTask",
    "Fail",
    "InvalidTaskError",
    "LeaseLost",
    "ResultError",
    "Retry",
    "Snooze",
    "TaskContext",
    "TaskError",
    "TaskFunction",
    "TaskNotFound",
    "TaskResult",
    "Tasks",
    "Worker",
    "migrate_tasks",
]
