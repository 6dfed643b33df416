"""One command: embedded PostgreSQL and NATS, the order service and the billing service.

    pip install -e ".[fastapi,embedded]"                   # from the repository's root
    python examples/fastapi_orders/run.py                   # serves until Ctrl-C
    python examples/fastapi_orders/run.py --demo            # places orders, checks, exits 0

The order service listens on http://127.0.0.1:8000 (``--port``; docs at ``/docs``) with its
relay in its lifespan; the billing service consumes from NATS into its own database.
``--dsn`` / ``--nats`` use servers you run instead of the embedded ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psycopg
import uvicorn

sys.path.insert(0, str(Path(__file__).parent))

import billing_service
from orders_service import Settings, create_app


@contextlib.asynccontextmanager
async def services(orders: Settings, billing_dsn: str, port: int) -> AsyncIterator[str]:
    """The order service (uvicorn, relay embedded) and the billing consumer, running;
    yields the order service's base URL."""
    await asyncio.to_thread(billing_service.prepare, billing_dsn)
    server = uvicorn.Server(
        uvicorn.Config(create_app(orders), host="127.0.0.1", port=port, log_level="warning")
    )
    web = asyncio.create_task(server.serve())
    while not server.started:
        if web.done():
            await web  # raises what stopped it (a port in use, a failed lifespan)
            raise RuntimeError("the order service stopped before it started")
        await asyncio.sleep(0.05)
    billing = billing_service.consumer(billing_dsn, orders.nats_url, orders.stream, orders.topic)
    consuming = asyncio.create_task(billing.run())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        billing.stop()
        server.should_exit = True
        await asyncio.gather(web, consuming)


async def demo(base_url: str, billing_dsn: str) -> None:
    """Three orders, one refused after its write (rolled back); waits for the invoices."""
    async with httpx.AsyncClient(base_url=base_url) as http:
        placed = []
        for customer, cents in [("ada", 4200), ("bob", 250_000), ("cy", 990), ("di", 1700)]:
            r = await http.post("/orders", json={"customer": customer, "total_cents": cents})
            print(f"POST /orders {customer} {cents} -> {r.status_code} {r.json()}")
            if r.status_code == 201:
                placed.append(r.json()["id"])
    async with await psycopg.AsyncConnection.connect(billing_dsn, autocommit=True) as conn:
        for _ in range(300):
            cur = await conn.execute("SELECT order_id FROM invoices ORDER BY order_id")
            invoiced = [row[0] for row in await cur.fetchall()]
            if set(placed) <= set(invoiced):
                print(f"invoiced orders {invoiced}; the refused order never left the database")
                return
            await asyncio.sleep(0.1)
    raise SystemExit(f"invoices missing: placed {placed}, invoiced {invoiced}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dsn", help="an admin URL (postgresql://...) of a PostgreSQL server (default: embedded)"
    )
    ap.add_argument("--nats", help="a NATS JetStream URL (default: embedded)")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port")
    ap.add_argument("--demo", action="store_true", help="place orders, check, exit")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        admin, nats_url = args.dsn, args.nats
        if admin is None or nats_url is None:
            from outboxkit.testing import EmbeddedNats, EmbeddedPostgres

            if admin is None:
                admin = stack.enter_context(EmbeddedPostgres()).dsn
            if nats_url is None:
                nats_url = stack.enter_context(EmbeddedNats()).url
        orders_dsn, billing_dsn = (_database(admin, name) for name in ("orders", "billing"))
        settings = Settings(dsn=orders_dsn, nats_url=nats_url)
        port = args.port or _free_port()
        async with services(settings, billing_dsn, port) as url:
            print(f"orders: {url}/docs   billing: {billing_dsn}   NATS: {nats_url}")
            if args.demo:
                await demo(url, billing_dsn)
            else:
                await asyncio.Event().wait()  # until Ctrl-C


def _database(admin: str, name: str) -> str:
    """The URL of database ``name`` on ``admin``'s server, created if missing."""
    with psycopg.connect(admin, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')
    return urlsplit(admin)._replace(path=f"/{name}").geturl()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
