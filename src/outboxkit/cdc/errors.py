"""The errors of the WAL side: the slot, its stream and its set-up, each saying what to do.

The classes live in ``outboxkit.errors`` with every other error (one place to find what
to catch); this module re-exports them for ``outboxkit.cdc`` and says how to recover.
"""

from __future__ import annotations

from outboxkit.backends import backend_for
from outboxkit.errors import (
    CdcError,
    CdcSetupError,
    ReplicationConnectionLost,
    ReplicationError,
    SlotInUse,
    SlotInvalidated,
    SlotNotFound,
)

__all__ = [
    "CdcError",
    "CdcSetupError",
    "ReplicationConnectionLost",
    "ReplicationError",
    "SlotInUse",
    "SlotInvalidated",
    "SlotNotFound",
    "invalidated_message",
    "refuse_without_wal",
]


def refuse_without_wal(dsn: str) -> None:
    """ConfigurationError, at once, if ``dsn``'s database has no logical replication (the
    backend says why: MariaDB/MySQL's, backends/mariadb/backend.py)."""
    backend_for(dsn).refuse("cdc")


def invalidated_message(slot: str, table: str, since: str | None = None) -> str:
    """What happened to an invalidated slot and the exact steps to recover from it."""
    when = f" since {since}" if since else ""
    return (
        f"replication slot {slot!r} is invalidated (wal_status 'lost'): the relay was down (or "
        f"behind) longer than max_slot_wal_keep_size allows, and PostgreSQL removed WAL the "
        f"slot had not consumed; events written{when} that the relay had not confirmed are no "
        f"longer in the WAL. To recover: "
        f"(1) stop the relays of this outbox; "
        f"(2) `outboxkit cdc drop --table {table}` then `outboxkit cdc setup --table {table}` "
        f"(the new slot streams from now on); "
        f"(3) start the relays; "
        f"(4) reconcile the gap: rows of a table-mode outbox written in it are still in table "
        f"{table!r}: run the polling relay (`outboxkit relay` without --source cdc) until "
        f"`outboxkit status` shows no pending row (events published twice are absorbed by "
        f"consumers' inbox or the broker's dedup), while WAL-only events (storage='wal') "
        f"written in it are gone and must be re-emitted by the application from its state; "
        f"(5) raise max_slot_wal_keep_size (or alert earlier on the slot's lag) so it does "
        f"not happen again"
    )
