"""``Outbox(storage="table")``, the default: each event is a row of the outbox table.

The statements are ``store.postgres``'s (``Statements``); this module picks the variant
each write needs and lays out its parameters, in ``store.postgres.WRITE_COLUMNS`` order
(``tests/unit/test_outbox_columns.py``). Two choices vary per write: whether it carries
the ``NOTIFY`` (not when every event is scheduled for later) and, for an ordered
outbox, which advisory locks of the events' keys it takes (:func:`lock_param`, the one
place that decides it for every path).
"""

from __future__ import annotations

import datetime as dt
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import orjson

from outboxkit.backends.postgres.postgres import WRITE_COLUMNS, Statements, numbered
from outboxkit.drivers import Statement
from outboxkit.events import Event
from outboxkit.write.storage import (
    OIDS,
    BinaryRow,
    Check,
    CommitStatement,
    Prepared,
    Send,
    commit_statement,
    encode_batch,
)

# One event's values in store.postgres.WRITE_COLUMNS order (tests/unit/test_outbox_columns.py).
_Row = tuple[
    Any, str, str | None, str, str | None, str | None, bytes, str | None, Any, str | None, Any
]
_KEY = [name for name, _ in WRITE_COLUMNS].index("key")
_AVAILABLE_AT = [name for name, _ in WRITE_COLUMNS].index("available_at")
# transaction(): the INSERT's parameter types, all sent in binary.
_TYPES = [OIDS[pg_type] for _, pg_type in WRITE_COLUMNS]
_INT32 = struct.Struct(">i")
_JSONB_VERSION = b"\x01"  # jsonb binary format: version byte, then the JSON text
# timestamptz binary format: microseconds since 2000-01-01 UTC, a big-endian int64.
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
_MICROSECOND = dt.timedelta(microseconds=1)
_INT64 = struct.Struct(">q")
_K = TypeVar("_K", str, bytes)


def _row(event: Event) -> _Row:
    """The put families' parameters of one event (psycopg and asyncpg adapt them)."""
    # No headers: NULL, which the INSERT turns into '{}' (store.postgres._VALUE).
    headers = orjson.dumps(event.headers).decode() if event.headers else None
    return (
        event.event_id,
        event.topic,
        event.key,
        event.event_type,
        event.aggregate_type,
        event.aggregate_id,
        event.payload,
        headers,
        event.occurred_at,
        event.schema_version,
        event.available_at,
    )


def _params(event: Event) -> BinaryRow:
    """``transaction()``'s parameters of one event in binary: encoded once, at ``tx.put``."""
    return [
        event.event_id.bytes,
        event.topic.encode(),
        event.key.encode() if event.key is not None else None,
        event.event_type.encode(),
        event.aggregate_type.encode() if event.aggregate_type is not None else None,
        event.aggregate_id.encode() if event.aggregate_id is not None else None,
        event.payload,
        _JSONB_VERSION + orjson.dumps(event.headers) if event.headers else None,
        _timestamptz(event.occurred_at),
        event.schema_version.encode() if event.schema_version is not None else None,
        _timestamptz(event.available_at) if event.available_at is not None else None,
    ]


def _timestamptz(value: dt.datetime) -> bytes:
    return _INT64.pack((value - _PG_EPOCH) // _MICROSECOND)


def any_due(available_at: Iterable[Any]) -> bool:
    """Whether any of the events is due now: only then is a NOTIFY worth sending.

    A scheduled event (``deliver_at``/``delay``) in the future would wake the relays
    for nothing; their poll finds it within ``poll_interval`` of its time.
    """
    now: dt.datetime | None = None
    for at in available_at:
        if at is None:
            return True
        if now is None:
            now = dt.datetime.now(dt.UTC)
        if at <= now:
            return True
    return False


def _first_due(rows: list[BinaryRow]) -> int:
    """The first queued row due now (it carries the NOTIFY), -1 if all are scheduled later."""
    now: int | None = None
    for i, row in enumerate(rows):
        at = row[_AVAILABLE_AT]
        if at is None:
            return i
        if now is None:
            now = (dt.datetime.now(dt.UTC) - _PG_EPOCH) // _MICROSECOND
        if _INT64.unpack(at)[0] <= now:
            return i
    return -1


def _text_array(items: Iterable[bytes]) -> bytes:
    """A one-dimensional text[] without NULLs, in PostgreSQL's binary array format."""
    values = list(items)
    header = struct.pack(">iiiii", 1, 0, OIDS["text"], len(values), 1)
    return header + b"".join(_INT32.pack(len(v)) + v for v in values)


def lock_param(
    keys: Sequence[_K | None], one_row: bool, array: Callable[[list[_K]], Any] = list
) -> tuple[bool, Any] | None:
    """Which key locks an ordered write of events with these ``keys`` takes: None if
    none has a key, else whether it locks several (``store.postgres.KEY_LOCKS``, a
    text[]) or one (``KEY_LOCK``, a text), and that parameter.

    A one-row statement (``put``, a one-event ``execute_with``, the first INSERT of
    ``transaction()``) locks a single distinct key through a text parameter: a
    one-element array cost ~40 µs of psycopg's list adaptation. Several keys, and every
    multi-row statement, take the distinct keys as one array (``array`` encodes it: a
    list for the drivers, binary for ``transaction()``); the SQL locks them in hash
    order, whatever order they come in, so two writers never wait for each other in a
    cycle.
    """
    if len(keys) == 1:  # one event (every ordered put): no set to build
        key = keys[0]
        if key is None:
            return None
        return (False, key) if one_row else (True, array([key]))
    distinct: set[Any] = set(keys)
    distinct.discard(None)
    if not distinct:
        return None
    if one_row and len(distinct) == 1:
        return False, distinct.pop()
    return True, array(list(distinct))


class TableStorage:
    """The statements of one outbox table's writes, by (locks keys, notifies)."""

    __slots__ = (
        "_attached",
        "_channel_bytes",
        "_inserts",
        "_locking",
        "_many",
        "_one",
        "channel",
        "notify",
        "ordered",
        "sql",
        "table",
    )

    def __init__(self, table: str, *, notify: bool, ordered: bool) -> None:
        self.table = table
        self.notify = notify
        self.ordered = ordered
        self.sql = sql = Statements(table)
        self.channel = sql.channel
        # A scheduled event's write sends no NOTIFY; only an ordered outbox's keyed
        # write takes the key locks.
        one = {
            (False, False): sql.insert_one,
            (False, True): sql.insert_one_notify,
            (True, False): sql.insert_one_ordered,
            (True, True): sql.insert_one_ordered_notify,
        }
        many = {
            (False, False): sql.insert_many,
            (False, True): sql.insert_many_notify,
            (True, False): sql.insert_many_ordered,
            (True, True): sql.insert_many_ordered_notify,
        }
        self._one = {k: Statement(v, numbered(v)) for k, v in one.items()}
        self._many = {k: Statement(v, numbered(v)) for k, v in many.items()}
        # execute_with: by (several events, locks keys, notifies), in %s style.
        self._attached = {
            (False, False, False): sql.attached_one,
            (False, False, True): sql.attached_one_notify,
            (False, True, False): sql.attached_one_ordered,
            (False, True, True): sql.attached_one_ordered_notify,
            (True, False, False): sql.attached_many,
            (True, False, True): sql.attached_many_notify,
            (True, True, False): sql.attached_many_ordered,
            (True, True, True): sql.attached_many_ordered_notify,
        }
        # transaction(): one prepared INSERT per event, by notifies; in ordered mode the
        # first one takes the transaction's key locks, by (several keys, notifies): no
        # command or round trip of their own, held only while the COMMIT travels.
        self._channel_bytes = self.channel.encode()
        text, text_array = OIDS["text"], OIDS["text[]"]
        self._inserts = {
            notifies: commit_statement(
                numbered(stmt), [*_TYPES, text] if notifies else _TYPES, b"outboxkit_put"
            )
            for notifies, stmt in ((False, sql.insert_one), (True, sql.insert_one_notify))
        }
        self._locking = {
            (several, notifies): commit_statement(
                numbered(stmt),
                [*_TYPES, text_array if several else text, *([text] if notifies else [])],
                b"outboxkit_put",
            )
            for several, notifies, stmt in (
                (False, False, sql.insert_one_ordered),
                (False, True, sql.insert_one_ordered_notify),
                (True, False, sql.insert_one_locking_keys),
                (True, True, sql.insert_one_locking_keys_notify),
            )
        }

    # -- put, put_many, execute_with --------------------------------------------------

    def one(self, event: Event) -> Prepared:
        params: list[Any] = list(_row(event))
        lock = lock_param((event.key,), True) if self.ordered else None
        if lock is not None:
            params.append(lock[1])
        notify = self.notify and (event.available_at is None or any_due([event.available_at]))
        if notify:
            params.append(self.channel)
        return self._one[lock is not None, notify], params

    def many(self, events: Iterable[Event], check: Check) -> Prepared | None:
        rows = encode_batch(events, check, _row)
        if not rows:
            return None
        # One array per column: one statement (unnest) whatever the count.
        params: list[Any] = [list(column) for column in zip(*rows, strict=True)]
        lock = lock_param(params[_KEY], False) if self.ordered else None
        if lock is not None:
            params.append(lock[1])
        notify = self.notify and any_due(params[_AVAILABLE_AT])
        if notify:
            params.append(self.channel)
        return self._many[lock is not None, notify], params

    def attached(self, events: Iterable[Event], check: Check) -> tuple[str, list[Any]] | None:
        rows = encode_batch(events, check, _row)
        if not rows:
            return None
        several = len(rows) > 1
        if several:
            params: list[Any] = [list(column) for column in zip(*rows, strict=True)]
        else:
            params = list(rows[0])
        lock = lock_param([r[_KEY] for r in rows], not several) if self.ordered else None
        if lock is not None:
            params.append(lock[1])
        notify = self.notify and any_due(r[_AVAILABLE_AT] for r in rows)
        if notify:
            params.append(self.channel)
        return self._attached[several, lock is not None, notify], params

    # -- transaction() ----------------------------------------------------------------

    def encode(self, event: Event) -> BinaryRow:
        return _params(event)

    def commit_inserts(self, rows: list[BinaryRow], send: Send) -> None:
        # PostgreSQL folds repeats of one notification: the first row due now carries it
        # (none when every event is scheduled for later).
        notify_at = _first_due(rows) if self.notify else -1
        lock = None
        if self.ordered:
            lock = lock_param([r[_KEY] for r in rows], True, _text_array)
        channel = self._channel_bytes
        for i, row in enumerate(rows):
            if i == 0 and lock is not None:
                # The key locks, before this row and the later ones take their ids.
                several, param = lock
                if i == notify_at:
                    send(self._locking[several, True], [*row, param, channel])
                else:
                    send(self._locking[several, False], [*row, param])
            elif i == notify_at:
                send(self._inserts[True], [*row, channel])
            else:
                send(self._inserts[False], row)

    def prepared(self) -> list[CommitStatement]:
        return [*self._inserts.values(), *self._locking.values()]
