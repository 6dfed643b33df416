"""The port of a fleet's lease on one database (fleet/leases.py divides the databases;
backends/<db>/fleet_sql.py keeps the lease in each database)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Sighting:
    """What one lease check saw in a database: its owner (None: free) and the processes
    whose heartbeat is still within a lease there."""

    owner: str | None
    members: frozenset[str]


class DatabaseLease(Protocol):
    """One fleet process's lease on one database."""

    async def check(self, want: bool) -> Sighting:
        """Heartbeat, and take or keep the database (``want``) or hand it back."""
        ...

    async def leave(self) -> None:
        """Forget this process here: its heartbeat and ownership (a graceful stop)."""
        ...
