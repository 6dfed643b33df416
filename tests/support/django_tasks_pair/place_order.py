"""``python -m tests.support.django_tasks_pair.place_order MODE NAME``: a view's work, an
order (a Group row) and its ``ship`` task, then the process dies after the COMMIT (the test
SIGKILLs it while the first ``on_commit`` callback, the crash window, sleeps).

MODE: ``outboxkit`` (enqueued in the block), ``tasks-db`` (django-tasks-db's enqueue in the
block) or ``tasks-db-on-commit`` (django-tasks-db's enqueue in ``on_commit``, the pattern
Django's docs give for enqueueing work that reads the transaction's rows).
"""

import sys
import time
from functools import partial

import django

django.setup()

from django.contrib.auth.models import Group  # noqa: E402
from django.db import transaction  # noqa: E402

from tests.support.django_tasks_pair import jobs  # noqa: E402


def crash_window() -> None:
    """Runs after the COMMIT, before the next callback: the process is killed here."""
    print("committed", flush=True)
    time.sleep(120)


mode, name = sys.argv[1], sys.argv[2]
with transaction.atomic():
    order = Group.objects.create(name=name)
    if mode == "outboxkit":
        jobs.ship.enqueue(order.id)
    elif mode == "tasks-db":
        jobs.ship_db.enqueue(order.id)
    transaction.on_commit(crash_window)
    if mode == "tasks-db-on-commit":
        transaction.on_commit(partial(jobs.ship_db.enqueue, order.id))
print("not killed", flush=True)
