"""``Outbox(storage="mariadb")``: each event a row of a MariaDB/MySQL outbox table.

The statements are ``backends.mariadb.sql``'s; ``put_many`` is one multi-row INSERT (one
round trip). MariaDB has no NOTIFY (the relay polls), and ``execute_with`` and
``transaction()`` (PostgreSQL's CTE and pipeline) are refused in one line.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, NoReturn

import orjson

from outboxkit.backends.mariadb.sql import Statements
from outboxkit.drivers import Statement
from outboxkit.errors import ConfigurationError
from outboxkit.events import Event
from outboxkit.write.storage import BinaryRow, Check, CommitStatement, Prepared, Send, encode_batch


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    """A naive UTC datetime (the columns are UTC DATETIME(6); drivers drop a tzinfo)."""
    if value is None:
        return None
    if value.tzinfo is not None:
        value = value.astimezone(dt.UTC)
    return value.replace(tzinfo=None)


def _row(event: Event) -> tuple[Any, ...]:
    """One event's values in the INSERT's column order."""
    return (
        str(event.event_id),
        event.topic,
        event.key,
        event.event_type,
        event.aggregate_type,
        event.aggregate_id,
        event.payload,
        orjson.dumps(event.headers).decode() if event.headers else "{}",
        _utc(event.available_at),
        _utc(event.occurred_at),
        event.schema_version,
    )


def _refuse(what: str) -> NoReturn:
    raise ConfigurationError(
        f"{what} is PostgreSQL's only: on MariaDB/MySQL use put()/put_many() inside your"
        " transaction"
    )


class MariaDBTableStorage:
    """Rows of a MariaDB outbox table, written with the caller's DB-API connection."""

    def __init__(self, table: str, *, ordered: bool = False) -> None:
        if ordered:
            raise ConfigurationError(
                "ordered=True is not available on MariaDB/MySQL yet: its per-key commit"
                " order needs a transaction-scoped lock MariaDB lacks (GET_LOCK is per session)"
            )
        self.sql = Statements(table)
        self.table = table
        self.notify = False  # no NOTIFY on MariaDB: the relay polls
        self._one = self._statement(1)

    def _statement(self, count: int) -> Statement:
        text = self.sql.insert_columns + ", ".join([self.sql.insert_row] * count)
        return Statement(text, text)

    def one(self, event: Event) -> Prepared:
        return self._one, list(_row(event))

    def many(self, events: Iterable[Event], check: Check) -> Prepared | None:
        rows = encode_batch(events, check, _row)
        if not rows:
            return None
        # One multi-row INSERT: one statement and one round trip whatever the count.
        return self._statement(len(rows)), [value for row in rows for value in row]

    def attached(self, events: Iterable[Event], check: Check) -> tuple[str, list[Any]] | None:
        _refuse("execute_with()")

    def encode(self, event: Event) -> BinaryRow:
        _refuse("Outbox.transaction()")

    def commit_inserts(self, rows: list[BinaryRow], send: Send) -> None:
        _refuse("Outbox.transaction()")

    def prepared(self) -> list[CommitStatement]:
        return []
