"""Where an ``Outbox`` keeps its events: the interface its two storages implement.

``Outbox(storage=...)`` picks one at construction: ``table.TableStorage`` (a row of the
outbox table per event, for any relay) or ``wal.WalStorage`` (a transactional logical
message per event, for the CDC relay). The outbox owns the event check (a batch's is
handed over, so each event is checked and encoded in one pass) and runs statements
through the driver adapters; a storage turns events into statements and parameters,
for each write path: ``put`` (``one``), ``put_many`` (``many``), ``execute_with``
(``attached``) and ``transaction()`` (``encode`` and ``commit_inserts``: binary
parameters and prepared statements sent in the COMMIT's pipeline).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any, NamedTuple, Protocol, TypeVar

from outboxkit.drivers import Statement
from outboxkit.drivers.psycopg_private import Key
from outboxkit.events import Event
from outboxkit.limits import MAX_BATCH_EVENTS, too_many_events

#: A statement of the put families and its parameters.
Prepared = tuple[Statement, list[Any]]
#: The outbox's event check (type and its size limits); returns the event.
Check = Callable[[object], Event]
#: One event's parameters in ``transaction()``'s pipeline, each in binary (None is NULL).
BinaryRow = list[bytes | None]

_R = TypeVar("_R")

#: PostgreSQL type oids of the parameters ``transaction()`` sends in binary.
OIDS = {"uuid": 2950, "text": 25, "bytea": 17, "jsonb": 3802, "timestamptz": 1184, "text[]": 1009}


class CommitStatement(NamedTuple):
    """A statement of ``transaction()``'s pipeline, prepared once per connection.

    ``key`` is psycopg's prepared-statement cache key (the ``$n`` text, the parameter
    types): the commit registers it there (``drivers.psycopg_private``), so whatever
    psycopg deallocates it forgets too. The name follows the text, so outboxes of one
    table share it. Every parameter travels in binary.
    """

    key: Key
    name: bytes
    types: list[int]
    formats: list[int]


#: Queues one statement of the COMMIT's pipeline with its parameters.
Send = Callable[[CommitStatement, BinaryRow], None]


class Storage(Protocol):
    """What every write path asks of the storage its outbox chose."""

    table: str
    notify: bool

    def one(self, event: Event) -> Prepared:
        """The statement and parameters that write one checked event (``put``)."""
        ...

    def many(self, events: Iterable[Event], check: Check) -> Prepared | None:
        """One statement for ``events``, each checked (``put_many``); None for none."""
        ...

    def attached(self, events: Iterable[Event], check: Check) -> tuple[str, list[Any]] | None:
        """The CTE (``%s`` style) and its parameters that write ``events``, each checked,
        in front of the caller's statement (``execute_with``); None for none."""
        ...


class PipelinedStorage(Protocol):
    """What ``transaction()``'s pipeline (write/commit.py) asks of a storage: rows encoded
    as ``tx.put`` queues them, and the statements sent with the COMMIT. PostgreSQL's table
    and WAL storages and task mode's enqueue have it; MariaDB's transaction() is its own
    (write/mariadb_commit.py), so its storage is a :class:`Storage` only."""

    table: str

    def encode(self, event: Event) -> BinaryRow:
        """A checked event's binary parameters, encoded when ``tx.put`` queues it."""
        ...

    def commit_inserts(self, rows: list[BinaryRow], send: Send) -> None:
        """Queue the statements that write ``rows`` (at least one) before the COMMIT."""
        ...

    def prepared(self) -> list[CommitStatement]:
        """Every statement ``commit_inserts`` may have prepared on a connection."""
        ...


def encode_batch(events: Iterable[Event], check: Check, encode: Callable[[Event], _R]) -> list[_R]:
    """``events`` checked and encoded in one pass; refuses more than a batch's worth
    without reading further (a generator may be endless)."""
    encoded = [encode(check(e)) for e in islice(events, MAX_BATCH_EVENTS + 1)]
    if len(encoded) > MAX_BATCH_EVENTS:
        raise too_many_events()
    return encoded


def commit_statement(text: str, types: Iterable[int], prefix: bytes) -> CommitStatement:
    """The prepared statement of ``text`` (``$n`` style) named ``<prefix>_<crc32 of text>``."""
    encoded = text.encode()
    type_list = list(types)
    return CommitStatement(
        (encoded, tuple(type_list)),
        b"%s_%08x" % (prefix, zlib.crc32(encoded)),
        type_list,
        [1] * len(type_list),
    )
