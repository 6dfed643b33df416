"""A stock Celery app for the bridge's tests, run by a real ``celery worker`` process.

Configured from the environment the test gives the worker: the broker URL, the queue,
an optional result backend, and the file each run of ``record`` appends a line to
(task id, its argument, when it ran and the ETA the worker saw).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

app = Celery(
    "outboxkit_celery_test",
    broker=os.environ.get("OUTBOXKIT_CELERY_BROKER", "memory://"),
    backend=os.environ.get("OUTBOXKIT_CELERY_BACKEND") or None,
)
app.conf.update(
    task_default_queue=os.environ.get("OUTBOXKIT_CELERY_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    enable_utc=True,
)


@app.task(name="outboxkit_test.record", bind=True)
def record(self: Any, n: int) -> int:
    """Note the run in the record file (one line, appended: runs are counted, not deduped)."""
    line = {"id": self.request.id, "n": n, "ran_at": time.time(), "eta": self.request.eta}
    with open(os.environ["OUTBOXKIT_CELERY_RECORD"], "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
    return n


@app.task(name="outboxkit_test.add")
def add(x: int, y: int) -> int:
    return x + y
