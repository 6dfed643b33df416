"""A web request's transaction that dispatches a Celery task, then dies right after COMMIT.

``python -m tests.support.celery_dispatcher MODE DSN ORDER_ID`` inserts an order and
dispatches ``outboxkit_test.record(ORDER_ID)``:

* ``on_commit``: Celery's usual pattern (``transaction.on_commit(lambda: task.delay())``):
  the task is published after the COMMIT, from the process itself;
* ``outboxkit``: ``outboxkit.contrib.celery.send_task`` inside the transaction.

It prints ``committed`` after the COMMIT and then waits where ``on_commit`` callbacks
run, so the test can SIGKILL it in the window between the COMMIT and the publish.
"""

from __future__ import annotations

import sys
import time

import psycopg

from outboxkit.contrib.celery import send_task


def main(mode: str, dsn: str, order_id: int) -> None:
    after_commit = []
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO celery_orders (id) VALUES (%s)", (order_id,))
            if mode == "outboxkit":
                send_task(conn, "outboxkit_test.record", (order_id,), queue=_queue())
            else:
                after_commit.append(order_id)
        print("committed", flush=True)
        time.sleep(30)  # the process dies here: between the COMMIT and the on_commit publish
        if after_commit:
            from tests.support.celery_app import app

            app.send_task("outboxkit_test.record", (order_id,), queue=_queue())


def _queue() -> str:
    import os

    return os.environ["OUTBOXKIT_CELERY_QUEUE"]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
