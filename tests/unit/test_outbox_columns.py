"""The outbox's column list is defined once (store.postgres.WRITE_COLUMNS): everything
that lists the columns in order is derived from it or pinned to it here."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import uuid

import orjson

from outboxkit import Event
from outboxkit.backends.postgres.postgres import (
    CLAIM_BATCH,
    CLAIM_RETURNING,
    WRITE_COLUMNS,
    Statements,
)
from outboxkit.publishers.base import OutboundMessage
from outboxkit.write.table import _TYPES, _params, _row

_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
_NAMES = [name for name, _ in WRITE_COLUMNS]


def _event() -> Event:
    # every field distinct, so a swapped pair cannot go unnoticed
    return Event(
        topic="t-topic",
        event_type="t-type",
        payload=b"t-payload",
        key="t-key",
        aggregate_type="t-agg-type",
        aggregate_id="t-agg-id",
        headers={"h": "v"},
        schema_version="t-version",
        deliver_at=dt.datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC),
    )


def test_the_inserts_list_the_columns_in_order() -> None:
    sql = Statements("outbox")
    listed = f"({', '.join(_NAMES)})"
    for stmt in (sql.insert_one, sql.insert_many):
        assert listed in stmt
    assert sql.insert_one.count("%s") == len(WRITE_COLUMNS)
    assert sql.insert_many.count("%s") == len(WRITE_COLUMNS)
    # ordered: the same columns, then the keys to lock
    for stmt in (sql.insert_one_ordered, sql.insert_many_ordered):
        assert listed in stmt
        assert stmt.count("%s") == len(WRITE_COLUMNS) + 1


def test_the_writes_row_follows_the_column_list() -> None:
    event = _event()
    row = _row(event)
    assert len(row) == len(WRITE_COLUMNS)
    for value, name in zip(row, _NAMES, strict=True):
        expected = getattr(event, name)
        assert (orjson.loads(value) if name == "headers" else value) == expected, name


def test_the_commits_binary_parameters_follow_the_column_list() -> None:
    event = _event()
    decode = {
        "uuid": lambda b: uuid.UUID(bytes=b),
        "text": bytes.decode,
        "bytea": bytes,
        "jsonb": lambda b: orjson.loads(b[1:]),
        "timestamptz": lambda b: (
            _PG_EPOCH + dt.timedelta(microseconds=int.from_bytes(b, "big", signed=True))
        ),
    }
    params = _params(event)
    assert len(params) == len(_TYPES) == len(WRITE_COLUMNS)
    for value, (name, pg_type) in zip(params, WRITE_COLUMNS, strict=True):
        assert value is not None
        assert decode[pg_type](value) == getattr(event, name), name


def test_the_claim_returns_the_columns_in_outbound_message_field_order() -> None:
    assert CLAIM_RETURNING in CLAIM_BATCH
    returning = CLAIM_RETURNING.split("RETURNING", 1)[1]
    columns = [c.strip() for c in re.split(r",(?![^(]*\))", returning) if c.strip()]
    # coalesce(o.occurred_at, o.created_at) is the occurred_at field; attempts, attempt
    # o.headers::json is the headers field (sent as json for the relay's loader)
    names = [
        re.sub(r"^coalesce\(o\.(\w+),.*", r"\1", c).removeprefix("o.").removesuffix("::json")
        for c in columns
    ]
    assert names[0] == "id"  # the relay's handle, not a message field
    fields = [f.name for f in dataclasses.fields(OutboundMessage)]
    assert [n.replace("attempts", "attempt") for n in names[1:]] == fields
    # available_at is the claim's business (when a row may go), not a message field
    assert set(_NAMES) - {"available_at"} <= set(names)
