"""The billing service: consumes ``order.placed`` from NATS and invoices each order once.

A consumer runner (``NatsConsumer``) hands each event to :func:`invoice` inside the
transaction that records the event in the inbox (``processed_events``); a redelivered
event finds its record and is acknowledged without a second invoice. The message is
acknowledged only after that commit. Its own database, its own tables.

    BILLING_DSN=postgresql://postgres@localhost/billing NATS_URL=nats://127.0.0.1:4222 \\
        python billing_service.py
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg

from outboxkit import ReceivedEvent, migrate_inbox
from outboxkit.consumers.nats import NatsConsumer

INVOICES = """
CREATE TABLE IF NOT EXISTS invoices (
    order_id bigint PRIMARY KEY, customer text NOT NULL, total_cents int NOT NULL,
    event_id uuid NOT NULL, created_at timestamptz NOT NULL DEFAULT now()
)
"""


async def invoice(tx: psycopg.AsyncConnection[Any], event: ReceivedEvent) -> None:
    """Runs once per event, in the transaction that records it in the inbox."""
    order = event.json()
    await tx.execute(
        "INSERT INTO invoices (order_id, customer, total_cents, event_id) VALUES (%s, %s, %s, %s)",
        (order["order_id"], order["customer"], order["total_cents"], event.event_id),
    )


def prepare(dsn: str) -> None:
    migrate_inbox(dsn)  # processed_events (or: outboxkit migrate --inbox)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(INVOICES)


def consumer(
    dsn: str, nats_url: str, stream: str = "ORDERS", topic: str = "orders"
) -> NatsConsumer:
    return NatsConsumer(
        dsn, invoice, consumer="billing", servers=nats_url, stream=stream, subject=topic
    )


async def main() -> None:
    dsn = os.environ.get("BILLING_DSN", "postgresql://postgres@localhost/postgres")
    nats_url = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
    prepare(dsn)
    runner = consumer(
        dsn,
        nats_url,
        os.environ.get("NATS_STREAM", "ORDERS"),
        os.environ.get("ORDERS_TOPIC", "orders"),
    )
    await runner.run()  # until cancelled (Ctrl-C)


if __name__ == "__main__":
    asyncio.run(main())
