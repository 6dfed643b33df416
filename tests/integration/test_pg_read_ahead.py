"""The async connections read on while the socket has data (backends/postgres/_read_ahead.py):
the same rows with fewer event-loop round trips, and never so long that the loop starves."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Generator
from typing import Any

import psycopg
import pytest

from outboxkit.backends.postgres._connection import aconnect
from outboxkit.backends.postgres._read_ahead import _AHEAD_MAX, ReadAheadConnection, _read_ahead

_ROWS = "SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 3000) g"


async def _rows_and_waits(conn: psycopg.AsyncConnection[Any]) -> tuple[list[Any], int]:
    """The query's rows, and how many times the loop was asked to watch the socket."""
    loop = asyncio.get_running_loop()
    added = 0
    add_reader = loop.add_reader

    def counting(fd: Any, callback: Any, *args: Any) -> None:
        nonlocal added
        added += 1
        add_reader(fd, callback, *args)

    loop.add_reader = counting  # type: ignore[method-assign]
    try:
        cur = conn.cursor(binary=True)
        # A busy client: the loop is held while the server sends, so the rows wait in the
        # socket (as they do while the relay encodes a batch).
        loop.call_soon(time.sleep, 0.2)
        await cur.execute(_ROWS)
        return await cur.fetchall(), added
    finally:
        del loop.add_reader


async def test_the_same_rows_with_fewer_trips_through_the_loop(db_dsn: str) -> None:
    async with await aconnect(db_dsn, application_name="outboxkit-test:ahead") as ahead:
        assert isinstance(ahead, ReadAheadConnection)
        async with await psycopg.AsyncConnection.connect(db_dsn, autocommit=True) as plain:
            rows, ahead_waits = await _rows_and_waits(ahead)
            plain_rows, plain_waits = await _rows_and_waits(plain)
    assert rows == plain_rows and len(rows) == 3000
    # ~800 kB of rows: psycopg's own wait goes through the loop for each piece it reads,
    # the read-ahead only when the socket has run dry.
    assert plain_waits > 5
    assert ahead_waits * 2 < plain_waits, (ahead_waits, plain_waits)


def test_reading_ahead_gives_the_loop_its_turn_on_an_always_readable_socket() -> None:
    """Adversarial: a socket that never runs dry (a server streaming a huge result) must not
    keep the event loop out; the naive read-ahead (no bound) never yields."""
    a, b = socket.socketpair()
    try:
        b.sendall(b"x")  # readable from now on: nothing reads it
        reads = 0

        def endless() -> Generator[int, int, None]:
            nonlocal reads
            while True:
                ready = yield 1  # (psycopg's Wait.R)
                if ready:
                    reads += 1
                if reads >= 10 * _AHEAD_MAX:
                    return

        wrapped = _read_ahead(endless(), a.fileno())
        yielded = 0
        state = next(wrapped)
        try:
            while True:
                yielded += 1
                assert state == 1
                state = wrapped.send(1)  # (the loop found it readable)
        except StopIteration:
            pass
        # One trip through the loop at least every _AHEAD_MAX reads: about a tenth of them.
        assert yielded >= 10 * _AHEAD_MAX // (_AHEAD_MAX + 1)
        assert reads == 10 * _AHEAD_MAX
    finally:
        a.close()
        b.close()


def test_a_wait_the_socket_cannot_answer_goes_through_the_loop() -> None:
    a, b = socket.socketpair()
    try:

        def once() -> Generator[int, int, str]:
            ready = yield 1
            return f"ready={ready}"

        wrapped = _read_ahead(once(), a.fileno())
        assert next(wrapped) == 1  # nothing to read: handed to the caller's wait
        with pytest.raises(StopIteration) as stop:
            wrapped.send(0)
        assert stop.value.value == "ready=0"
    finally:
        a.close()
        b.close()


def test_without_select_poll_the_connections_are_psycopgs_own() -> None:
    """Windows has no ``select.poll``: the read-ahead steps aside rather than failing a query."""
    import subprocess
    import sys

    script = (
        "import select; del select.poll\n"
        "import psycopg\n"
        "from outboxkit.backends.postgres._read_ahead import connection_class\n"
        "assert connection_class is psycopg.AsyncConnection, connection_class\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
