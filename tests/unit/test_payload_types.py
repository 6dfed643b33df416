"""Payloads users have: Decimal, datetime, UUID, dataclasses, pydantic models, their own types."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import uuid
from typing import Any

import orjson
import pydantic
import pytest

from outboxkit import Event, Outbox
from outboxkit.errors import InvalidEventError


class Currency(enum.Enum):
    EUR = "EUR"


@dataclasses.dataclass
class Line:
    sku: str
    price: decimal.Decimal


class Order(pydantic.BaseModel):
    id: uuid.UUID
    placed_at: dt.datetime
    total: decimal.Decimal
    lines: list[Line]


class Money:
    """A type of the user's own: only their default= hook knows it."""

    def __init__(self, cents: int) -> None:
        self.cents = cents


ORDER_ID = uuid.UUID("0190a0a0-0000-7000-8000-000000000001")
PLACED = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)


def _event(payload: Any) -> Event:
    return Event(topic="orders", event_type="order.placed", payload=payload)


def test_decimal_datetime_uuid_dataclass_and_enum_are_encoded() -> None:
    """Before: `Type is not JSON serializable: decimal.Decimal` at Event()."""
    payload = {
        "id": ORDER_ID,
        "at": PLACED,
        "day": PLACED.date(),
        "total": decimal.Decimal("19.90"),
        "currency": Currency.EUR,
        "line": Line("a-1", decimal.Decimal("0.10")),
    }
    assert orjson.loads(_event(payload).payload) == {
        "id": str(ORDER_ID),
        "at": "2026-11-26T12:00:00+00:00",
        "day": "2026-11-26",
        "total": "19.90",
        "currency": "EUR",
        "line": {"sku": "a-1", "price": "0.10"},
    }


def test_a_pydantic_model_is_encoded_as_its_json_dump() -> None:
    order = Order(id=ORDER_ID, placed_at=PLACED, total=decimal.Decimal("1.5"), lines=[])
    assert orjson.loads(_event(order).payload) == order.model_dump(mode="json")
    assert orjson.loads(_event({"order": order}).payload)["order"]["total"] == "1.5"


def test_the_outbox_default_hook_encodes_the_users_own_types() -> None:
    event = _event({"items": [{"price": Money(1990)}]})
    outbox = Outbox(default=lambda v: {"cents": v.cents} if isinstance(v, Money) else None)
    assert outbox._check(event) is event
    assert orjson.loads(event.payload) == {"items": [{"price": {"cents": 1990}}]}


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({"items": [{}, {}, {"price": Money(1)}]}, "payload.items[2].price: Money"),
        ([1, {"a": {1, 2}}], "payload[1].a: set"),
        ({"line": Line("x", Money(1))}, "payload.line.price: Money"),  # type: ignore[arg-type]
    ],
)
def test_an_unserialisable_value_fails_at_put_naming_its_path(payload: Any, where: str) -> None:
    """Before: `Type is not JSON serializable: Money`, with no word of where it is."""
    event = _event(payload)
    with pytest.raises(InvalidEventError) as caught:
        Outbox()._check(event)
    assert where in str(caught.value), str(caught.value)
    assert "default=" in str(caught.value)


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({"a": [1, {1: "x"}]}, "payload.a[1]: key 1 is a int, not a string"),
        ({"a": [1, {"n": "\ud800"}]}, "payload.a[1].n: str"),
        ({"n": 2**70}, "payload.n: int"),
    ],
)
def test_values_no_hook_can_fix_fail_at_construction_by_their_path(
    payload: Any, where: str
) -> None:
    with pytest.raises(InvalidEventError) as caught:
        _event(payload)
    assert where in str(caught.value), str(caught.value)


def test_a_default_hook_that_refuses_still_names_the_path() -> None:
    def refuse(value: Any) -> Any:
        raise TypeError(f"cannot encode {type(value).__name__}")

    with pytest.raises(InvalidEventError, match=r"payload\.price: Money"):
        Outbox(default=refuse)._check(_event({"price": Money(5)}))
