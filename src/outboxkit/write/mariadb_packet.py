"""``Outbox.transaction()``'s INSERTs within the server's ``max_allowed_packet`` (MariaDB/MySQL).

The server refuses a query longer than ``max_allowed_packet`` (error 1153) and drops the
connection, and the MySQL drivers quote the values into the query's text, so a
transaction's events, sent as one multi-row INSERT with the COMMIT, can outgrow it. Sizes
are counted as PyMySQL quotes them (bytes in hex, ``_binary X'…'``; strings escaped;
mysqlclient and asyncmy quote shorter), an upper bound for every driver.

The limit is asked once per connection (``SELECT @@max_allowed_packet``; the value is
read-only in a session) and only when a transaction's events may take more than
:data:`ASK_ABOVE`, so the usual small transaction costs no round trip. Over the limit,
the rows are split into several INSERTs, sent one after the other, the last with the
COMMIT; an event that alone exceeds it is refused before anything is sent.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import weakref
from collections.abc import Sequence
from typing import Any

from outboxkit.backends.mariadb.sql import MAX_ALLOWED_PACKET
from outboxkit.errors import InvalidEventError

#: Under this bound of a query's size the limit is not asked: every server default is at
#: least 1 MiB (16 MiB on MariaDB 10.2+, 64 MiB on MySQL 8); a server set lower than
#: 64 KiB (the minimum is 1 KiB) answers a longer query with its own error 1153.
ASK_ABOVE = 64 * 1024
#: The command byte, ``;\nCOMMIT`` and the ``;\n`` between a query's INSERTs, with room.
SLACK = 64
#: The characters the drivers escape in a quoted string (one more byte each).
_ESCAPED = b"\\'\"\x00\n\r\x1a"
_DATETIME = len("'2026-12-05 17:03:16.123456'")
#: Connections whose limit is known (a connection that takes no weak reference asks again).
_LIMITS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def quick_size(row: Sequence[Any]) -> int:
    """An upper bound of ``row``'s quoted values, without encoding them (``put``'s cost)."""
    size = 0
    for value in row:
        if type(value) is bytes:
            size += 2 * len(value) + 11
        elif type(value) is str:
            size += 4 * len(value) + 2  # at most 4 UTF-8 bytes a character, 2 if escaped
        else:
            size += _DATETIME  # None, a datetime, an int: no longer than a datetime
    return size


def exact_size(row: Sequence[Any]) -> int:
    """``row``'s quoted values as PyMySQL sends them (no shorter with another driver)."""
    size = 0
    for value in row:
        if value is None:
            size += 4
        elif type(value) is bytes:
            size += 2 * len(value) + 11
        elif type(value) is str:
            encoded = value.encode()
            size += 2 * len(encoded) - len(encoded.translate(None, _ESCAPED)) + 2
        elif isinstance(value, dt.datetime):
            size += _DATETIME
        else:
            size += len(str(value)) + 2
    return size


def known(conn: Any) -> int | None:
    """The connection's limit if already asked."""
    try:
        return _LIMITS.get(conn)
    except TypeError:
        return None


def _remember(conn: Any, limit: Any) -> int:
    value = int(limit)
    with contextlib.suppress(TypeError):  # not weakly referenceable: asked again next time
        _LIMITS[conn] = value
    return value


def ask(conn: Any) -> int:
    """The connection's ``max_allowed_packet`` (one round trip, once per connection)."""
    limit = known(conn)
    if limit is None:
        with conn.cursor() as cur:
            cur.execute(MAX_ALLOWED_PACKET)
            limit = _remember(conn, cur.fetchone()[0])
    return limit


async def aask(conn: Any) -> int:
    """:func:`ask` for aiomysql and asyncmy."""
    limit = known(conn)
    if limit is None:
        async with conn.cursor() as cur:
            await cur.execute(MAX_ALLOWED_PACKET)
            limit = _remember(conn, (await cur.fetchone())[0])
    return limit


def too_large(position: int, row: Sequence[Any], size: int, limit: int) -> InvalidEventError:
    """The refusal of the event at ``position`` whose INSERT alone takes ``size`` bytes."""
    return InvalidEventError(
        f"event #{position + 1} of this transaction (topic {row[1]!r}, event_id {row[0]})"
        f" takes {size} bytes in its INSERT, more than the server's max_allowed_packet of"
        f" {limit} bytes: nothing of this transaction was sent. Raise max_allowed_packet"
        " (SET GLOBAL max_allowed_packet = …, for new connections; bytes payloads are sent"
        " in hex, twice their length) or send a reference to the payload instead"
    )


def chunks(
    sizes: Sequence[int], fixed: int, per_row: int, limit: int, max_rows: int
) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of rows, in order and filled greedily, whose INSERTs
    (``fixed`` bytes, then ``per_row`` plus the values' ``sizes[i]`` for each row, at most
    ``max_rows`` rows) each fit ``limit``; :class:`_RowTooLarge` for a row that fits in
    none (its position and its INSERT's size)."""
    budget = limit - SLACK
    ranges: list[tuple[int, int]] = []
    start, total = 0, fixed
    for i, size in enumerate(sizes):
        cost = per_row + size
        if fixed + cost > budget:
            raise _RowTooLarge(i, fixed + cost)
        if i > start and (total + cost > budget or i - start >= max_rows):
            ranges.append((start, i))
            start, total = i, fixed
        total += cost
    if sizes:
        ranges.append((start, len(sizes)))
    return ranges


class _RowTooLarge(Exception):
    """A row no INSERT can carry under the limit (position, size): control flow only."""

    def __init__(self, position: int, size: int) -> None:
        super().__init__(position, size)
        self.position = position
        self.size = size
