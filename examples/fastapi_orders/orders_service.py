"""The order service: FastAPI + SQLAlchemy async; each order and its event commit together.

``POST /orders`` writes the order through the ORM and queues its ``order.placed`` event with
``outbox.adefer(session, ...)``; both go to PostgreSQL with the session's COMMIT (on psycopg
the event's INSERT rides in the COMMIT's round trip). A request that fails after the write
(an order over the credit limit) rolls both back: no order, no event. The relay runs inside
the app (its lifespan) unless ``ORDERS_EMBEDDED_RELAY=0``; then run it on its own:
``outboxkit relay --dsn "$ORDERS_DSN" --broker "$NATS_URL?stream=ORDERS"``.

    ORDERS_DSN=postgresql://postgres@localhost/orders NATS_URL=nats://127.0.0.1:4222 \\
        uvicorn orders_service:app        # from this directory
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import nats
from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import BigInteger, Integer, Text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outboxkit import Event, Outbox, Relay, from_url, migrate

CREDIT_LIMIT_CENTS = 100_000


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    customer: Mapped[str] = mapped_column(Text)
    total_cents: Mapped[int] = mapped_column(Integer)


class NewOrder(BaseModel):
    customer: str = Field(min_length=1, max_length=200)
    total_cents: int = Field(gt=0)


class PlacedOrder(BaseModel):
    id: int
    customer: str
    total_cents: int
    event_id: str


@dataclass
class Settings:
    """From the environment by default; ``run.py`` and the tests pass their own."""

    dsn: str = field(
        default_factory=lambda: os.environ.get(
            "ORDERS_DSN", "postgresql://postgres@localhost/postgres"
        )
    )
    nats_url: str = field(
        default_factory=lambda: os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
    )
    stream: str = field(default_factory=lambda: os.environ.get("NATS_STREAM", "ORDERS"))
    topic: str = field(default_factory=lambda: os.environ.get("ORDERS_TOPIC", "orders"))
    embedded_relay: bool = field(
        default_factory=lambda: os.environ.get("ORDERS_EMBEDDED_RELAY", "1") != "0"
    )


outbox = Outbox()


def create_app(settings: Settings | None = None) -> FastAPI:
    s = settings or Settings()
    engine = create_async_engine(s.dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(migrate, s.dsn)  # the outbox table (or: outboxkit migrate)
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        await ensure_stream(s.nats_url, s.stream, s.topic)
        relay = (
            Relay(s.dsn, from_url(f"{s.nats_url}?stream={s.stream}")) if s.embedded_relay else None
        )
        running = asyncio.create_task(relay.run()) if relay is not None else None
        try:
            yield
        finally:
            if relay is not None and running is not None:
                relay.stop()  # finishes the batch in flight, hands back the rest
                await running
            await engine.dispose()

    app = FastAPI(title="orders", lifespan=lifespan)

    async def session() -> AsyncIterator[AsyncSession]:
        async with sessions() as db:
            yield db

    @app.post("/orders", status_code=201)
    async def place_order(new: NewOrder, db: AsyncSession = Depends(session)) -> PlacedOrder:  # noqa: B008
        async with db.begin():  # commits the order and its event, or neither
            order = Order(customer=new.customer, total_cents=new.total_cents)
            db.add(order)
            await db.flush()  # the order's id
            event = Event(
                topic=s.topic,
                event_type="order.placed",
                key=f"order-{order.id}",
                aggregate_type="order",
                aggregate_id=str(order.id),
                payload={
                    "order_id": order.id,
                    "customer": order.customer,
                    "total_cents": order.total_cents,
                },
            )
            await outbox.adefer(db, event)
            if order.total_cents > CREDIT_LIMIT_CENTS:  # a check that fails after the write
                raise HTTPException(
                    402, f"order over the credit limit of {CREDIT_LIMIT_CENTS} cents"
                )
        return PlacedOrder(
            id=order.id,
            customer=order.customer,
            total_cents=order.total_cents,
            event_id=str(event.event_id),
        )

    @app.get("/orders/{order_id}")
    async def get_order(order_id: int, db: AsyncSession = Depends(session)) -> dict[str, object]:  # noqa: B008
        order = await db.get(Order, order_id)
        if order is None:
            raise HTTPException(404, f"no order {order_id}")
        return {"id": order.id, "customer": order.customer, "total_cents": order.total_cents}

    return app


async def ensure_stream(nats_url: str, stream: str, topic: str) -> None:
    """The JetStream stream that stores the topic (a no-op when it exists)."""
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().add_stream(name=stream, subjects=[topic])
    finally:
        await nc.close()


def __getattr__(name: str) -> FastAPI:  # `uvicorn orders_service:app` builds it on demand
    if name == "app":
        return create_app()
    raise AttributeError(name)
