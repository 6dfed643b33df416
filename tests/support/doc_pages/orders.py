"""The order service docs/testing-your-code.md's snippets test, as a reader's project has it.

Copied as ``orders.py`` next to those snippets (tests/integration/test_doc_pages.py); every
name a snippet uses without defining comes from here: ``place_order`` (a DSN or an open
connection), ``announce``, ``orders.tasks`` and the ``receipt.send`` task, whose first mail
fails (the page's test expects the retry).
"""

from __future__ import annotations

import asyncio  # noqa: F401  (the inbox snippet's asyncio.run)
from typing import Any

import psycopg

from outboxkit import Event, Outbox
from outboxkit.pytest import received_event  # noqa: F401  (the inbox snippet's helper)
from outboxkit.tasks import Tasks

outbox = Outbox()
tasks = Tasks()
mails: dict[int, int] = {}

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                                   customer text NOT NULL, total_cents int NOT NULL);
CREATE TABLE IF NOT EXISTS invoices (order_id bigint PRIMARY KEY);
"""


def place_order(target: Any, customer: str, total_cents: int) -> int:
    """The order, its ``order.placed`` event and its receipt task, in one transaction."""
    if isinstance(target, str):
        with psycopg.connect(target) as conn:
            return place_order(conn, customer, total_cents)
    with target.transaction():
        target.execute(SCHEMA)
        (order_id,) = target.execute(
            "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
            (customer, total_cents),
        ).fetchone()
        payload = {"order_id": order_id, "customer": customer, "total_cents": total_cents}
        outbox.put(
            target, Event(topic="orders", event_type="order.placed", key=customer, payload=payload)
        )
        tasks.enqueue(target, "receipt.send", {"order_id": order_id})
    return int(order_id)


def announce(writer: Any, tx: Any, order_id: int) -> None:
    writer.put(
        tx, Event(topic="orders", event_type="order.announced", payload={"order_id": order_id})
    )


@tasks.handler("receipt.send", retry=[0, 5], max_attempts=3)
def send_receipt(payload: dict[str, Any]) -> None:
    order_id = payload["order_id"]
    mails[order_id] = mails.get(order_id, 0) + 1
    if mails[order_id] == 1:
        raise ConnectionError("the mail server timed out")
