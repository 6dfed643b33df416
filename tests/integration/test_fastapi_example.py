"""examples/fastapi_orders end to end over HTTP: orders through FastAPI + SQLAlchemy async
(the event deferred to the COMMIT), the relay in the app's lifespan, NATS, the billing
service's inbox. Each committed order's event arrives exactly once; a refused one never."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx
import nats

from outboxkit.testing import create_database, drop_database, free_port
from tests.support.servers import unique_name

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi_orders"


@pytest.fixture
def example() -> Iterator[Any]:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import run

        yield run
    finally:
        sys.path.remove(str(EXAMPLE))
        for name in ("run", "orders_service", "billing_service"):
            sys.modules.pop(name, None)


@pytest.fixture
def billing_dsn(pg_server: Any) -> Iterator[str]:
    name = unique_name("billing")
    dsn = create_database(pg_server.dsn, name)
    yield dsn
    drop_database(pg_server.dsn, name)


async def test_orders_over_http_are_invoiced_once_and_a_refused_one_never(
    example: Any, empty_db_dsn: str, billing_dsn: str, nats_server: Any
) -> None:
    stream, topic = unique_name("ORDERS"), unique_name("orders")
    settings = example.Settings(
        dsn=empty_db_dsn, nats_url=nats_server.url, stream=stream, topic=topic
    )
    try:
        async with (
            example.services(settings, billing_dsn, free_port()) as url,
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            placed: dict[int, str] = {}
            for i, cents in enumerate([4200, 990, 250_000, 1700, 12]):
                r = await http.post("/orders", json={"customer": f"c{i}", "total_cents": cents})
                if cents > 100_000:
                    assert r.status_code == 402, r.text  # refused after its write: rolled back
                    continue
                assert r.status_code == 201, r.text
                placed[r.json()["id"]] = r.json()["event_id"]
            assert (
                await http.post("/orders", json={"customer": "", "total_cents": 1})
            ).status_code == 422
            invoices = await _invoices(billing_dsn, len(placed))
            assert (await http.get(f"/orders/{next(iter(placed))}")).status_code == 200
        # The app has stopped (its relay with it): nothing more can arrive.
        assert {row[0]: str(row[1]) for row in invoices} == placed
        with psycopg.connect(empty_db_dsn) as conn:
            orders = conn.execute("SELECT id, total_cents FROM orders ORDER BY id").fetchall()
            left = conn.execute("SELECT count(*) FROM outbox").fetchone()
        assert [o[0] for o in orders] == sorted(placed)  # the refused order was rolled back
        assert left == (0,)
        published = await _stream_messages(nats_server.url, stream)
        ids = [m["id"] for m in published]
        assert sorted(ids) == sorted(placed.values()), "each committed order's event, once"
        assert {m["order_id"] for m in published} == set(placed)
        with psycopg.connect(billing_dsn) as conn:
            records = conn.execute(
                "SELECT count(*) FROM processed_events WHERE consumer_name = 'billing'"
            ).fetchone()
        assert records == (len(placed),)
    finally:
        await _delete_stream(nats_server.url, stream)


async def _invoices(dsn: str, n: int) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for _ in range(300):
            cur = await conn.execute("SELECT order_id, event_id FROM invoices ORDER BY order_id")
            rows = await cur.fetchall()
            if len(rows) >= n:
                return rows
            await asyncio.sleep(0.05)
    raise AssertionError(f"{len(rows)} invoices of {n} after 15 s")


async def _stream_messages(url: str, stream: str) -> list[dict[str, Any]]:
    """Every message the stream stores, read by sequence (the broker's side)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        state = (await js.stream_info(stream)).state
        out = []
        for seq in range(state.first_seq, state.last_seq + 1):
            msg = await js.get_msg(stream, seq)
            headers = msg.headers or {}
            out.append(
                {"id": str(uuid.UUID(headers["Nats-Msg-Id"])), **json.loads(msg.data or b"{}")}
            )
        return out
    finally:
        await nc.close()


async def _delete_stream(url: str, stream: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream(stream)
    except Exception:  # noqa: S110 - never created
        pass
    finally:
        await nc.close()
