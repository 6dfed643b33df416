"""The private psycopg state outboxkit reads or updates, all in this one module.

psycopg has no public API for any of it. ``tests/unit/test_psycopg_private.py``
fails loudly when a release renames one of these, and ``pyproject.toml`` caps
psycopg below its next major release until that test has run against it.

Why the prepared-statement cache: ``Outbox.transaction()`` prepares its INSERT
once per connection (a parse costs about as much as the rest of the write). psycopg
drops every prepared statement of the session with ``DEALLOCATE ALL`` after a
ROLLBACK, DROP, ALTER or DISCARD ALL, and evicts the least recently used past
``prepared_max``. Registering the outbox's statement in psycopg's own cache makes
psycopg's bookkeeping the one truth for both: whatever psycopg deallocates, it also
forgets, and the outbox prepares again on its next commit instead of failing the
caller's transaction.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from psycopg.waiting import Ready, Wait

# psycopg's cache key: (query bytes, parameter type oids).
Key = tuple[bytes, tuple[int, ...]]


def in_pipeline(conn: Any) -> bool:
    """Inside ``conn.pipeline()``: statements are queued, libpq's status lags."""
    return getattr(conn, "_pipeline", None) is not None


def open_transaction_blocks(conn: Any) -> int:
    """How many ``with conn.transaction():`` blocks are open on ``conn``."""
    return int(getattr(conn, "_num_transactions", 0))


def begin_command(conn: Any) -> bytes:
    """The BEGIN ``conn.transaction()`` sends: with the connection's isolation level,
    read-only and deferrable settings (psycopg builds it once and caches it)."""
    command: bytes = conn._get_tx_start_command()
    return command


def encoding(pgconn: Any) -> str:
    """The Python name of the connection's client encoding (to decode server errors)."""
    return str(getattr(pgconn, "_encoding", "utf-8"))


def prepared_name(conn: Any, key: Key) -> bytes | None:
    """The name under which ``key`` is prepared in the session, per psycopg's cache."""
    name: bytes | None = conn._prepared._names.get(key)
    if name is not None:
        conn._prepared._names.move_to_end(key)  # recently used: psycopg evicts the oldest
    return name


def flush_deallocations(conn: Any) -> Generator[Wait, Ready | int, None]:
    """Send the DEALLOCATEs psycopg has queued but not sent yet (after DDL in the block,
    it sends them before its next statement). Run before preparing, so a queued
    ``DEALLOCATE ALL`` cannot drop a statement prepared after it. Usually a no-op."""
    manager = conn._prepared
    if manager._to_flush:
        yield from manager.maintain_gen(conn)


def remember_prepared(conn: Any, key: Key, name: bytes) -> None:
    """Record in psycopg's cache that ``name`` is prepared for ``key``."""
    conn._prepared._names[key] = name


def forget_prepared(conn: Any, key: Key) -> None:
    """The server no longer has (or never got) the statement of ``key``."""
    conn._prepared._names.pop(key, None)
