"""Write docs/img/dashboard.png: a few minutes of real traffic, an outage, and dead letters.

    .venv/bin/python -m tests.support.dashboard_screenshot [--minutes 3]

Starts an embedded PostgreSQL and NATS, runs a relay and the dashboard, writes
orders at a steady rate, stops the relay for a while (the backlog grows, then
drains), sends some events to a subject no stream stores (they are
dead-lettered), and screenshots the page in headless Chromium.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path

import psycopg
from aiohttp import web

from outboxkit import Event, Outbox, Relay
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.ops.dashboard import Dashboard, dashboard_app
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.testing import EmbeddedNats, EmbeddedPostgres, free_port
from tests.support.servers import ensure_stream

OUT = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.png"
CHROMIUM = "/usr/bin/chromium"


def _write(dsn: str, topic: str, n: int, i0: int) -> None:
    events = [
        Event(
            topic=topic,
            event_type="order.placed" if topic.endswith("orders") else "invoice.issued",
            payload={"order_id": i0 + i, "total_cents": 1999 + i, "currency": "EUR"},
            key=f"customer-{(i0 + i) % 97}",
            aggregate_type="order",
            aggregate_id=str(i0 + i),
            headers={"tenant": "acme"},
        )
        for i in range(n)
    ]
    with psycopg.connect(dsn) as conn, conn.transaction():
        Outbox().put_many(conn, events)


async def main(minutes: float) -> None:
    with EmbeddedPostgres(fsync=False) as pg, EmbeddedNats() as nats:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE shop")
        dsn = pg.dsn_for("shop")
        migrate(dsn)
        await ensure_stream(nats.url, "SHOP", ["shop.>"])
        board = Dashboard(dsn, admin_token="demo-token-0123456789", sample_interval=2.0)
        runner = web.AppRunner(dashboard_app(board), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()

        def relay() -> Relay:
            return Relay(
                dsn,
                NatsPublisher.from_url(nats.url + "?timeout=1"),
                poll_interval=0.2,
                max_attempts=3,
                retry_base=0.5,
                retry_cap=2.0,
            )

        current = relay()
        task: asyncio.Task[None] | None = asyncio.create_task(current.run())
        total = minutes * 60
        outage = (total * 0.45, total * 0.65)
        started = time.monotonic()
        i = poisoned = 0
        shooting = asyncio.Event()
        shot: asyncio.Task[None] | None = None
        # Traffic keeps flowing while the screenshot is taken.
        while (elapsed := time.monotonic() - started) < total + 15:
            if outage[0] <= elapsed < outage[1] and task is not None:
                current.stop()
                await task
                task = None
            elif elapsed >= outage[1] and task is None:
                current = relay()
                task = asyncio.create_task(current.run())
            rate = 120 + 80 * ((int(elapsed) // 20) % 3)
            await asyncio.to_thread(_write, dsn, "shop.orders", rate // 4, i)
            await asyncio.to_thread(_write, dsn, "shop.invoices", rate // 8, i)
            if int(elapsed) // 37 > poisoned:
                poisoned += 1
                await asyncio.to_thread(_write, dsn, "billing.invoices", 1, i)  # no stream: fails
            i += rate
            if elapsed >= total and not shooting.is_set():
                shooting.set()
                shot = asyncio.create_task(_screenshot(port))
            await asyncio.sleep(0.25)
        if shot is not None:
            await shot
        if task is not None:
            current.stop()
            await task
        with contextlib.suppress(Exception):
            await runner.cleanup()
    print(f"wrote {OUT}")


async def _screenshot(port: int) -> None:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        page = await browser.new_page(viewport={"width": 1400, "height": 1000})
        await page.goto(f"http://127.0.0.1:{port}/")
        await page.fill("#token", "demo-token")
        await page.click("#token-save")
        await page.wait_for_selector("#failed tbody tr")
        await page.locator("#failed tbody tr button.view").first.click()
        await page.wait_for_selector("#detail:not([hidden])")
        await page.wait_for_timeout(4500)  # the toast fades
        OUT.parent.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(OUT), full_page=True)
        await browser.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    asyncio.run(main(parser.parse_args().minutes))
