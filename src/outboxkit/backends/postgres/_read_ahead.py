"""An async connection that reads on while its socket has data, before going back to the loop.

psycopg's asyncio wait (``psycopg.waiting.wait_async``) goes through the event loop for every
read a result needs: an ``add_reader``, a future and a timer, one loop iteration, a
``remove_reader``. PostgreSQL sends a large result in 8 kB pieces as it makes the rows, so a
relay's claim of 1 000 rows is some 30 such trips, each several times the cost of a read.
When the socket already holds the next piece (the server ran ahead of the client, as it does
while the relay decodes), a zero-timeout ``poll()`` says so for the cost of one system call
and the read happens at once; otherwise the wait goes through the loop as before.

At most :data:`_AHEAD_MAX` reads in a row skip the loop, so a server streaming a huge
result cannot keep the loop's other tasks waiting.
"""

from __future__ import annotations

import select
from typing import Any

import psycopg
from psycopg.abc import PQGen
from psycopg.waiting import READY_R, WAIT_R

_AHEAD_MAX = 32


def _read_ahead(gen: PQGen[Any], fileno: int) -> PQGen[Any]:
    """``gen``, with each wait for reading answered at once while the socket is readable."""
    poller = select.poll()
    poller.register(fileno, select.POLLIN)
    poll = poller.poll
    try:
        s = next(gen)
        ahead = 0
        while True:
            if s == WAIT_R and ahead < _AHEAD_MAX and poll(0):
                ahead += 1
                s = gen.send(READY_R)
                continue
            ahead = 0
            s = gen.send((yield s))
    except StopIteration as ex:
        return ex.value


class ReadAheadConnection(psycopg.AsyncConnection[Any]):
    """``psycopg.AsyncConnection`` whose waits read on while the socket is readable."""

    async def wait(self, gen: PQGen[Any], *args: Any, **kwargs: Any) -> Any:
        return await super().wait(_read_ahead(gen, self.pgconn.socket), *args, **kwargs)


#: The class outboxkit's async PostgreSQL connections are made of: psycopg's own where the
#: platform has no ``select.poll`` (Windows), where the read-ahead cannot ask the socket.
connection_class: type[psycopg.AsyncConnection[Any]] = (
    ReadAheadConnection if hasattr(select, "poll") else psycopg.AsyncConnection
)
