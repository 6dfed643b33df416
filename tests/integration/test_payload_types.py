"""Payloads with Decimal, datetime, UUID, dataclasses, pydantic and the user's own types, written
through a real PostgreSQL transaction; an unencodable value fails the put by its path."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import uuid
from typing import Any

import orjson
import psycopg
import pydantic
import pytest

from outboxkit import Event, Outbox
from outboxkit.errors import InvalidEventError


class Money:
    def __init__(self, cents: int) -> None:
        self.cents = cents


@dataclasses.dataclass
class Line:
    sku: str
    price: Any


class Order(pydantic.BaseModel):
    id: uuid.UUID
    total: decimal.Decimal
    placed_at: dt.datetime


def _money(value: Any) -> Any:
    if isinstance(value, Money):
        return {"cents": value.cents}
    raise TypeError(f"{type(value).__name__} is not money")


def test_payloads_users_have_are_stored_as_json(db_dsn: str) -> None:
    """Before: Event() raised `Type is not JSON serializable: decimal.Decimal`."""
    order = Order(
        id=uuid.uuid4(), total=decimal.Decimal("19.90"), placed_at=dt.datetime.now(dt.UTC)
    )
    outbox = Outbox(default=_money)
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        outbox.put(conn, Event(topic="orders", event_type="placed", payload=order))
        outbox.put(
            conn,
            Event(
                topic="orders",
                event_type="priced",
                payload={"lines": [Line("a", Money(1990)), Line("b", decimal.Decimal("0.5"))]},
            ),
        )
    with psycopg.connect(db_dsn) as conn:
        rows = [bytes(r[0]) for r in conn.execute("SELECT payload FROM outbox ORDER BY id")]
    assert orjson.loads(rows[0]) == order.model_dump(mode="json")
    assert orjson.loads(rows[1]) == {
        "lines": [{"sku": "a", "price": {"cents": 1990}}, {"sku": "b", "price": "0.5"}]
    }


def test_an_unencodable_value_fails_the_put_by_its_path_and_leaves_the_transaction_usable(
    db_dsn: str,
) -> None:
    event = Event(topic="orders", event_type="x", payload={"items": [1, 2, {"price": Money(1)}]})
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        with pytest.raises(InvalidEventError, match=r"payload\.items\[2\]\.price: Money"):
            Outbox().put(conn, event)
        Outbox().put(conn, Event(topic="orders", event_type="y", payload={"ok": True}))
    with psycopg.connect(db_dsn) as conn:
        assert conn.execute("SELECT event_type FROM outbox").fetchall() == [("y",)]
