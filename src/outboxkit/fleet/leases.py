"""How several fleet processes given the same file divide its databases among themselves.

Each database keeps its own lease (backends/<db>/fleet_sql.py): every process that sees the
database writes a heartbeat there at each round (every third of a lease), and at most one of
them owns it; a process not seen for a lease is gone, and its ownership with it. The live
processes are the heartbeats seen across the databases, so each process aims at
``ceil(D / N)`` databases (D reachable databases, N live processes): one owning more hands
the extras back (its service stops gracefully first), one owning fewer takes free ones. No
coordinator outside the databases; a process not owning a database runs no service on it
and only checks its lease, on a short connection, once a round.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import socket
from collections.abc import Iterable

from outboxkit.queue.fleet_leases import DatabaseLease, Sighting

__all__ = ["DatabaseLease", "Sighting", "member_id", "rank", "target"]


def member_id() -> str:
    """This process's name in the lease tables: host (the pod's name), pid and a nonce."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def target(reachable: int, members: Iterable[str]) -> int:
    """How many databases a process aims at: ``ceil(D / N)``."""
    live = max(1, len(set(members)))
    return math.ceil(reachable / live)


def rank(member: str, name: str) -> bytes:
    """A process's preference order over databases: each process prefers different ones,
    so processes starting together do not all race for the same free database."""
    return hashlib.blake2b(f"{member}\0{name}".encode(), digest_size=8).digest()
