"""A small order service: the order row and its `order.placed` event commit together.

Its tests (tests/) use only outboxkit's testing kit: `pytest -p outboxkit.pytest` or, as
here, `pytest_plugins = ["outboxkit.pytest"]` in the top-level conftest.py.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outboxkit import Event, Outbox, ReceivedEvent
from outboxkit.tasks import Tasks

outbox = Outbox()
tasks = Tasks()

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text NOT NULL,
    total_cents int NOT NULL
);
CREATE TABLE IF NOT EXISTS invoices (order_id bigint PRIMARY KEY, total_cents int NOT NULL);
CREATE TABLE IF NOT EXISTS receipts (order_id bigint PRIMARY KEY);
"""

#: Where the receipt task sends its mail; a test swaps it for a fake that fails on cue.
mailer: Any = None


def create_schema(conn: psycopg.Connection[Any]) -> None:
    with conn.transaction():
        conn.execute(SCHEMA)


def order_placed(order_id: int, customer: str, total_cents: int) -> Event:
    """The event an order's placement publishes (keyed by customer: their events stay in order)."""
    return Event(
        topic="orders",
        event_type="order.placed",
        key=customer,
        aggregate_type="order",
        aggregate_id=str(order_id),
        payload={"order_id": order_id, "customer": customer, "total_cents": total_cents},
    )


def announce(writer: Any, tx: Any, order_id: int, customer: str, total_cents: int) -> None:
    """Write the event with ``writer.put(tx, ...)``: an ``Outbox`` and a connection in
    production, a ``MemoryOutbox`` and its transaction in a unit test."""
    writer.put(tx, order_placed(order_id, customer, total_cents))


def place_order(conn: psycopg.Connection[Any], customer: str, total_cents: int) -> int:
    """Insert the order, its event and its receipt task in one transaction; a refused
    order leaves none of them."""
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
            (customer, total_cents),
        ).fetchone()
        assert row is not None
        order_id = int(row[0])
        announce(outbox, conn, order_id, customer, total_cents)
        tasks.enqueue(conn, "receipt.send", {"order_id": order_id, "customer": customer})
        if total_cents <= 0:
            raise ValueError(f"order {order_id}: the total must be positive")
    return order_id


async def invoice(conn: psycopg.AsyncConnection[Any], event: ReceivedEvent) -> None:
    """Billing's handler, run behind the inbox in billing's transaction."""
    placed = event.json()
    await conn.execute(
        "INSERT INTO invoices (order_id, total_cents) VALUES (%s, %s)",
        (placed["order_id"], placed["total_cents"]),
    )


@tasks.handler("receipt.send", retry=[0, 5], max_attempts=3)
def send_receipt(payload: dict[str, Any]) -> None:
    """Mail the receipt (run by `outboxkit worker --app orders:tasks`); a failure retries."""
    mailer.send(payload["customer"], f"receipt for order {payload['order_id']}")
