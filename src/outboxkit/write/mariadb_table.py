"""``Outbox(storage="mariadb")``: each event a row of a MariaDB/MySQL outbox table.

The statements are ``backends.mariadb.sql``'s; ``put_many`` is one multi-row INSERT (one
round trip); ``transaction()`` sends it with the COMMIT (``write.mariadb_commit``). MariaDB
has no NOTIFY: a write of events due now wakes the relays of this process instead
(``backends.mariadb.wakeup``). ``execute_with`` (PostgreSQL's CTE) is refused in one line.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, NoReturn

import orjson

from outboxkit.backends.mariadb import wakeup
from outboxkit.backends.mariadb.sql import Statements, insert_ordered, key_slot
from outboxkit.drivers import Statement
from outboxkit.errors import ConfigurationError
from outboxkit.events import Event
from outboxkit.write.storage import Check, Prepared, encode_batch


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


#: How many values a row has (each a ``%s`` of the INSERT's text).
_VALUES = 11


def due(rows: list[tuple[Any, ...]]) -> bool:
    """Whether any row is due now (its ``available_at`` unset or past): only those wake."""
    now: dt.datetime | None = None
    for row in rows:
        at = row[8]
        if at is None:
            return True
        if now is None:
            now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        if at <= now:
            return True
    return False


def _refuse(what: str) -> NoReturn:
    raise ConfigurationError(
        f"{what} is PostgreSQL's only: on MariaDB/MySQL use put()/put_many() inside your"
        " transaction"
    )


class MariaDBTableStorage:
    """Rows of a MariaDB outbox table, written with the caller's DB-API connection."""

    def __init__(self, table: str, *, ordered: bool = False) -> None:
        self.sql = Statements(table)
        self.table = table
        self.ordered = ordered  # keyed rows lock their keys first (sql.insert_ordered)
        self.notify = False  # no NOTIFY on MariaDB: in-process wake-ups instead (wakeup)
        self._one = self._statement(1)

    def _statement(self, count: int) -> Statement:
        text = self.sql.insert_columns + ", ".join([self.sql.insert_row] * count)
        return Statement(text, text)

    def _locking(self, rows: list[tuple[Any, ...]], slots: list[int] | None = None) -> Prepared:
        """Ordered mode: the INSERT that locks the rows' keys before they take their ids
        (``slots``: those of a whole transaction whose rows are split over several)."""
        if slots is None:
            slots = self.slots(rows)
        text = insert_ordered(self.table, len(rows), len(slots))
        return Statement(text, text), [*slots, *(value for row in rows for value in row)]

    def slots(self, rows: list[tuple[Any, ...]]) -> list[int]:
        """Ordered mode: the key lock rows ``rows`` take, in order (none otherwise)."""
        if not self.ordered:
            return []
        return sorted({key_slot(row[2]) for row in rows if row[2] is not None})

    def shape(self, slots: int) -> tuple[int, int]:
        """(fixed, per row): an INSERT's bytes besides its values' (write/mariadb_packet.py),
        for ``slots`` key locks; an upper bound."""
        placeholders = _VALUES
        if not slots:
            row = len(self.sql.insert_row) - 2 * placeholders
            return len(self.sql.insert_columns) - 2, row + 2  # rows joined by ", "
        one = len(insert_ordered(self.table, 1, slots))
        two = len(insert_ordered(self.table, 2, slots))
        row = two - one - 2 * placeholders
        # A slot's "%s" is at most 5 digits; a row's order number at most 6 more than "1".
        return one - 2 * placeholders + 3 * slots - row, row + 6

    def one(self, event: Event) -> Prepared:
        row = _row(event)
        self._writing([row])
        if self.ordered and event.key is not None:
            return self._locking([row])
        return self._one, list(row)

    def many(self, events: Iterable[Event], check: Check) -> Prepared | None:
        rows = encode_batch(events, check, _row)
        if not rows:
            return None
        self._writing(rows)
        return self.insert(rows)

    def _writing(self, rows: list[tuple[Any, ...]]) -> None:
        """``put``'s rows commit when the caller commits: in-process relays re-poll a while."""
        if wakeup.has_relays() and due(rows):
            wakeup.writing(self.table)

    def insert(self, rows: list[tuple[Any, ...]], slots: list[int] | None = None) -> Prepared:
        """The one INSERT of ``rows`` (at least one, at most a batch's worth); ``slots``:
        ordered mode's key locks to take (all of a transaction's, when split)."""
        if self.ordered and (slots or any(row[2] is not None for row in rows)):
            return self._locking(rows, slots)
        # One multi-row INSERT: one statement and one round trip whatever the count.
        stmt = self._one if len(rows) == 1 else self._statement(len(rows))
        return stmt, [value for row in rows for value in row]

    #: One event's values, as ``transaction()`` queues them.
    row = staticmethod(_row)

    def attached(self, events: Iterable[Event], check: Check) -> tuple[str, list[Any]] | None:
        _refuse("execute_with()")
