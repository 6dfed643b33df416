"""MariaDB's stand-in for NOTIFY: writers wake the relays of their own process.

MariaDB has no LISTEN/NOTIFY, so a relay in another process only polls. A relay in the
writer's process (``Relay(...)`` beside a web app, ``outboxkit.testing``) listens here, and
a write through outboxkit to a table of the same name wakes it at once:

* ``Outbox.transaction()`` sends the COMMIT itself, so it calls :func:`committed` once the
  server confirmed it: the waiting relay claims at once.
* ``put``/``put_many`` run inside the caller's transaction and a DB-API connection has no
  commit hook, so they call :func:`writing`: the waiting relay wakes, and for
  :data:`WRITING_WINDOW` seconds no relay can close the gate, so each re-polls after 5, 10,
  20 … 100 ms (the claim loop's gate retry) and finds the rows soon after the caller's
  COMMIT; a COMMIT later than that waits for the poll.

The gate is PostgreSQL's (backends/postgres/postgres.py ``WAKE_GATE``): one relay of a table at a
time holds it while it waits, and only it is woken; a relay that found work opens it. While events
flow nobody holds it, and a writer pays a dictionary look-up, no system call. Events due later
(``deliver_at``) wake nobody. Tables are matched by their bare name, lower-cased (``shop.outbox``
and ``outbox`` meet): a write to a namesake table of another database costs the relay one claim that
finds nothing."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

#: How long after a ``put`` the relays re-poll for the caller's COMMIT.
WRITING_WINDOW = 1.0

_lock = threading.Lock()
_tables: dict[str, _Table] = {}


class _Table:
    __slots__ = ("holder", "writing_until")

    def __init__(self) -> None:
        self.holder: Gate | None = None
        self.writing_until = 0.0


def _name(table: str) -> str:
    return table.rsplit(".", 1)[-1].lower()


class Gate:
    """One relay's (one queue store's) side of its table's gate, and its wake-up."""

    __slots__ = ("_loop", "_wake", "table")

    def __init__(self, table: str) -> None:
        self.table = _name(table)
        self._wake: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def close(self) -> bool:
        """Be woken by writers from now on; False while another relay of the table is, or
        a ``put`` may still commit (:data:`WRITING_WINDOW`): the loop then re-polls."""
        with _lock:
            table = _tables.setdefault(self.table, _Table())
            if time.monotonic() < table.writing_until:
                return False
            if table.holder is None:
                table.holder = self
            return table.holder is self

    def open(self) -> None:
        with _lock:
            table = _tables.get(self.table)
            if table is not None and table.holder is self:
                table.holder = None

    @property
    def closed(self) -> bool:
        table = _tables.get(self.table)
        return table is not None and table.holder is self

    def listen(self, wake: Callable[[], None]) -> None:
        """Deliver wake-ups to ``wake``, on the running event loop (from any thread)."""
        with _lock:
            self._loop, self._wake = asyncio.get_running_loop(), wake

    def stop_listening(self) -> None:
        with _lock:
            self._loop = self._wake = None
        self.open()

    def _deliver(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed: the relay is gone
                loop.call_soon_threadsafe(wake)


def committed(table: str) -> None:
    """Events of ``table``, due now, were committed: wake the relay waiting for them."""
    if not _tables:  # the common case: no relay in this process
        return
    with _lock:
        found = _tables.get(_name(table))
        holder = None if found is None else found.holder
    if holder is not None:
        holder._deliver()


def writing(table: str) -> None:
    """Events of ``table``, due now, were written in a transaction whose COMMIT outboxkit
    does not see: the waiting relay wakes and the relays re-poll for a while."""
    if not _tables:
        return
    with _lock:
        found = _tables.get(_name(table))
        if found is None:
            return
        found.writing_until = time.monotonic() + WRITING_WINDOW
        holder, found.holder = found.holder, None  # the gate opens; the loop closes it later
    if holder is not None:
        holder._deliver()


def has_relays() -> bool:
    """Whether a relay of this process ever waited on a MariaDB table (a writer's fast path)."""
    return bool(_tables)
