"""Outbox rows as pgoutput sends them (text values) turned into the relay's messages.

pgoutput sends every column of an INSERT in its text output format: a uuid as text,
bytea as ``\\x<hex>`` (``bytea_output = hex``, the server default), jsonb as JSON text
and timestamptz in the ISO DateStyle. The message's ``created_at`` is the commit time,
which the stream gives with the transaction.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping

import orjson

from outboxkit.backends.postgres.postgres import Status
from outboxkit.errors import UndecodableRow
from outboxkit.publishers.base import OutboundMessage

_PENDING = str(int(Status.PENDING)).encode()


def is_pending(values: Mapping[str, bytes | None]) -> bool:
    """Whether an inserted row is an event to publish: dead letters are inserted as failed."""
    status = values.get("status")
    return status is None or status == _PENDING


def row_id(values: Mapping[str, bytes | None]) -> int | None:
    raw = values.get("id")
    return int(raw) if raw is not None else None


def _text(values: Mapping[str, bytes | None], column: str) -> str | None:
    raw = values.get(column)
    return None if raw is None else raw.decode()


def _required(values: Mapping[str, bytes | None], column: str) -> str:
    text = _text(values, column)
    if text is None:
        raise UndecodableRow(f"outbox row without {column}")
    return text


def parse_timestamp(text: str) -> dt.datetime:
    """A timestamptz in PostgreSQL's ISO style (``2026-11-23 11:29:00.12+00``)."""
    value = dt.datetime.fromisoformat(text)
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


def parse_bytea(text: str) -> bytes:
    if not text.startswith("\\x"):
        raise UndecodableRow("payload is not in bytea hex format (set bytea_output = hex)")
    return bytes.fromhex(text[2:])


def row_message(values: Mapping[str, bytes | None], commit_time: dt.datetime) -> OutboundMessage:
    """The message of one inserted outbox row; ``created_at`` is its transaction's commit time."""
    try:
        headers = orjson.loads(values.get("headers") or b"{}")
        occurred = _text(values, "occurred_at")
        return OutboundMessage(
            event_id=uuid.UUID(_required(values, "event_id")),
            topic=_required(values, "topic"),
            key=_text(values, "key"),
            event_type=_required(values, "event_type"),
            aggregate_type=_text(values, "aggregate_type"),
            aggregate_id=_text(values, "aggregate_id"),
            payload=parse_bytea(_required(values, "payload")),
            headers={str(k): str(v) for k, v in headers.items()},
            created_at=commit_time,
            occurred_at=parse_timestamp(occurred) if occurred is not None else None,
            schema_version=_text(values, "schema_version"),
        )
    except (ValueError, AttributeError, orjson.JSONDecodeError) as exc:
        raise UndecodableRow(f"outbox row not decodable: {exc}") from exc
