"""Run by test_django_psycopg2.py in a subprocess: the app on Django's psycopg2 backend.

Django picks psycopg 3 when it can import it, and outboxkit needs psycopg 3; this process
hides it while Django loads its backend (as Django < 4.2, or a project without psycopg 3,
would load it), then lets outboxkit import it. Prints one JSON object with what it saw.
"""

import json
import sys
import uuid

sys.modules["psycopg"] = None  # type: ignore[assignment]
import django.db.backends.postgresql.base  # noqa: E402  (loaded with psycopg2)

del sys.modules["psycopg"]

import django  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from outboxkit import Event  # noqa: E402
from outboxkit.errors import NotInTransactionError  # noqa: E402

django.setup()
from outboxkit.contrib.django import inbox, outbox, tasks  # noqa: E402


@tasks.handler("receipt.send")
def send_receipt(payload: object) -> None:
    pass


def event(n: int) -> Event:
    return Event(topic="orders", event_type="order.placed", key=f"o{n}", payload={"n": n})


seen: dict[str, object] = {}
with transaction.atomic():
    outbox.put(event(1))
    outbox.put_many([event(2), event(3)])
    seen["driver"] = type(connection.connection).__module__
    seen["inbox_first"] = inbox.mark("billing", uuid.UUID(int=1))
    seen["inbox_again"] = inbox.mark("billing", uuid.UUID(int=1))
    seen["enqueued"] = tasks.enqueue("receipt.send", {"n": 1}, unique_key="r1")
    seen["enqueued_again"] = tasks.enqueue("receipt.send", {"n": 2}, unique_key="r1")
try:
    with transaction.atomic():
        outbox.put(event(4))
        tasks.enqueue("receipt.send", {"n": 4})
        raise RuntimeError("rolled back")
except RuntimeError:
    pass
try:
    outbox.put(event(5))
except NotInTransactionError as exc:
    seen["refused"] = str(exc)
try:
    tasks.enqueue("receipt.send", {"n": 5})
except NotInTransactionError as exc:
    seen["task_refused"] = str(exc)
print(json.dumps(seen))
