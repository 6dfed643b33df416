"""Amazon SQS: orders and their events written atomically, relayed, invoiced exactly once.

    pip install -e ".[sqs]"
    OUTBOXKIT_DSN=postgresql://postgres@localhost/postgres AWS_DEFAULT_REGION=eu-west-1 \\
        python examples/sqs_orders.py   # SQS_ENDPOINT_URL=http://127.0.0.1:4566 for LocalStack

Exits 0 once every order it placed has its invoice. In production the relay
(`outboxkit relay --broker sqs://QUEUE`) and the consumer run as processes of their own.
"""

import asyncio
import os

import boto3
import psycopg

from outboxkit import Event, Outbox, ReceivedEvent, Relay, from_url, migrate, migrate_inbox
from outboxkit.consumers.sqs import SqsConsumer

DSN = os.environ.get("OUTBOXKIT_DSN", "postgresql://postgres@localhost/postgres")
ENDPOINT_URL = os.environ.get("SQS_ENDPOINT_URL")  # unset: AWS itself
TOPIC = os.environ.get("ORDERS_TOPIC", "orders")


def place_orders(totals: list[int]) -> list[int]:
    """The application's write: each order row and its event in one transaction."""
    outbox = Outbox()
    order_ids = []
    with psycopg.connect(DSN, autocommit=True) as conn:
        for total in totals:
            with outbox.transaction(conn) as tx:
                (order_id,) = conn.execute(
                    "INSERT INTO orders (total) VALUES (%s) RETURNING id", (total,)
                ).fetchone()
                tx.put(
                    Event(
                        topic=TOPIC,
                        event_type="order.placed",
                        key=f"order-{order_id}",
                        payload={"order_id": order_id, "total": total},
                    )
                )
            order_ids.append(order_id)
    return order_ids


async def invoice(tx: psycopg.AsyncConnection, event: ReceivedEvent) -> None:
    """Runs once per event, in the transaction that records it in the inbox."""
    order = event.json()
    await tx.execute(
        "INSERT INTO invoices (order_id, total) VALUES (%s, %s)",
        (order["order_id"], order["total"]),
    )


async def main() -> None:
    migrate(DSN)  # the outbox table (or: outboxkit migrate)
    migrate_inbox(DSN)  # processed_events (or: outboxkit migrate --inbox)
    with psycopg.connect(DSN, autocommit=True) as conn:
        # The README's orders table: the examples and the README run on one database.
        conn.execute(
            "CREATE TABLE IF NOT EXISTS orders (id serial PRIMARY KEY, customer text, total int)"
        )
        conn.execute("CREATE TABLE IF NOT EXISTS invoices (order_id int PRIMARY KEY, total int)")
    boto3.client("sqs", endpoint_url=ENDPOINT_URL).create_queue(QueueName=TOPIC)  # idempotent
    order_ids = place_orders([4200, 1700, 990])

    broker = f"sqs://{TOPIC}" + (f"?endpoint_url={ENDPOINT_URL}" if ENDPOINT_URL else "")
    relay = Relay(DSN, from_url(broker))
    billing = SqsConsumer(DSN, invoice, consumer="billing", queue=TOPIC, endpoint_url=ENDPOINT_URL)
    running = [asyncio.create_task(relay.run()), asyncio.create_task(billing.run())]
    try:
        await asyncio.wait_for(invoiced(order_ids), timeout=60)
    finally:
        relay.stop()  # finishes in-flight batches, hands back the rest
        billing.stop()  # finishes the message in hand
        await asyncio.gather(*running)
    print(f"placed and invoiced orders {order_ids} through SQS queue {TOPIC!r}")


async def invoiced(order_ids: list[int]) -> None:
    async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
        while True:
            cur = await conn.execute(
                "SELECT count(*) FROM invoices WHERE order_id = ANY(%s)", (order_ids,)
            )
            if (await cur.fetchone())[0] == len(order_ids):
                return
            await asyncio.sleep(0.2)


if __name__ == "__main__":
    asyncio.run(main())
