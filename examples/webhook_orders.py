"""Webhooks: orders and their events written atomically, POSTed signed, invoiced exactly once.

    pip install -e ".[webhook]"
    OUTBOXKIT_DSN=postgresql://postgres@localhost/postgres python examples/webhook_orders.py

The receiver (an aiohttp app in this process, on a free port) checks the Standard
Webhooks signature on the raw body, applies the event through the inbox and answers
2xx only after its transaction committed. Exits 0 once every order has its invoice.
A receiver with replay protection and CloudEvents headers: docs/brokers.md#webhooks.
"""

import asyncio
import base64
import hashlib
import hmac
import json
import os
from collections.abc import Mapping

import psycopg
from aiohttp import web

from outboxkit import Event, Inbox, Outbox, Relay, from_url, migrate, migrate_inbox

DSN = os.environ.get("OUTBOXKIT_DSN", "postgresql://postgres@localhost/postgres")
TOPIC = os.environ.get("ORDERS_TOPIC", "orders")
# Both sides read the secret from the environment (the relay from the variable that
# ?secret_env= names); here one is made up for the run unless you set it.
SECRET = os.environ.setdefault(
    "ORDERS_HOOK_SECRET", "whsec_" + base64.b64encode(os.urandom(32)).decode()
)


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


def signed(headers: Mapping[str, str], body: bytes) -> bool:
    """Standard Webhooks v1: base64 HMAC-SHA256 of "{webhook-id}.{webhook-timestamp}.{body}"."""
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    signed_content = f"{headers.get('webhook-id')}.{headers.get('webhook-timestamp')}.".encode()
    digest = hmac.new(key, signed_content + body, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(digest).decode()
    offered = headers.get("webhook-signature", "").split()  # several during a secret rotation
    return any(hmac.compare_digest(expected, signature) for signature in offered)


async def receive(request: web.Request) -> web.Response:
    body = await request.read()
    if not signed(request.headers, body):
        return web.Response(status=401)  # the relay dead-letters it: a wrong secret is not retried
    event_id = request.headers["webhook-id"]  # the event id: redeliveries carry the same
    async with (
        await psycopg.AsyncConnection.connect(DSN) as conn,
        conn.transaction(),
        Inbox().ahandle(conn, "billing", event_id) as fresh,
    ):
        if fresh:
            order = json.loads(body)
            await conn.execute(
                "INSERT INTO invoices (order_id, total) VALUES (%s, %s)",
                (order["order_id"], order["total"]),
            )
    return web.Response(status=204)  # only now: the invoice and the inbox record committed


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

    app = web.Application()
    app.router.add_post("/hooks/{topic}", receive)
    receiver = web.AppRunner(app, access_log=None)
    await receiver.setup()
    await web.TCPSite(receiver, "127.0.0.1", 0).start()  # a free port
    port = receiver.addresses[0][1]

    relay = Relay(
        DSN, from_url(f"http://127.0.0.1:{port}/hooks/{{topic}}?secret_env=ORDERS_HOOK_SECRET")
    )
    running = asyncio.create_task(relay.run())
    try:
        await asyncio.wait_for(invoiced(order_ids), timeout=60)
    finally:
        relay.stop()  # finishes in-flight batches, hands back the rest
        await running
        await receiver.cleanup()
    print(f"placed and invoiced orders {order_ids} through webhooks on port {port}")


async def invoiced(order_ids: list[int]) -> None:
    """Wait until every order has its invoice."""
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
