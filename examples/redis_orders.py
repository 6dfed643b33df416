"""Redis Streams: orders and their events written atomically, relayed, invoiced exactly once.

    pip install -e ".[redis]"
    OUTBOXKIT_DSN=postgresql://postgres@localhost/postgres REDIS_URL=redis://127.0.0.1:6379/0 \\
        python examples/redis_orders.py

Exits 0 once every order it placed has its invoice. In production the relay
(`outboxkit relay --broker redis://...`) and the consumer run as processes of their own.
"""

import asyncio
import os

import psycopg

from outboxkit import Event, Outbox, ReceivedEvent, Relay, from_url, migrate, migrate_inbox
from outboxkit.consumers.redis import RedisStreamsConsumer

DSN = os.environ.get("OUTBOXKIT_DSN", "postgresql://postgres@localhost/postgres")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
# The relay's streams live under a prefix: no event can name another application's keys.
PREFIX = "outbox:"


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
    order_ids = place_orders([4200, 1700, 990])

    relay_url = f"{REDIS_URL}{'&' if '?' in REDIS_URL else '?'}stream_prefix={PREFIX}"
    relay = Relay(DSN, from_url(relay_url))  # stream = prefix + topic
    billing = RedisStreamsConsumer(
        DSN, invoice, consumer="billing", url=REDIS_URL, streams=PREFIX + TOPIC
    )
    running = [asyncio.create_task(relay.run()), asyncio.create_task(billing.run())]
    try:
        await asyncio.wait_for(invoiced(order_ids), timeout=60)
    finally:
        relay.stop()  # finishes in-flight batches, hands back the rest
        billing.stop()  # finishes the message in hand
        await asyncio.gather(*running)
    print(f"placed and invoiced orders {order_ids} through Redis stream {PREFIX + TOPIC!r}")


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
