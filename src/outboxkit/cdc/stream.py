"""A logical replication slot read as an async stream of decoded items, in WAL commit order.

psycopg 3 has no replication protocol, so this uses psycopg2's `LogicalReplicationConnection`
(the `cdc` extra) in asynchronous mode: the connection's socket is watched with
`loop.add_reader`, `read_message()` never blocks, and no thread is involved. Each pgoutput
message is decoded (`pgoutput.py`) and handed over as soon as it is read, so a transaction
of 100 000 events is never held whole in memory.

Keeping the slot's connection alive is this module's job, even while the caller is not
reading (a broker outage pauses the relay): every `status_interval` seconds a standby status
(with the last confirmed position) goes to the server asking for a reply, and a server silent
for `timeout` seconds while the stream waits for data is a lost connection. Reconnecting is
the caller's job: it opens a new stream, which starts at the slot's confirmed position, so
everything not confirmed comes again.

psycopg2 moves the flush position it reports to a keepalive's WAL end by itself once the
caller has confirmed the start of the last message it read. A transaction that began before
the confirmed commit starts its messages below it (a message starts at its WAL record), so a
keepalive read among them would report every transaction read since as flushed, published or
not, and the next stream would skip them. The stream therefore reads no further while that
can happen (the confirmed position at or past the last message's start, and a transaction
read whole but not confirmed) until the caller confirms it:
tests/integration/test_cdc_stream.py shows the skipped transaction without this.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from outboxkit.cdc import pgoutput
from outboxkit.cdc.errors import (
    ReplicationConnectionLost,
    ReplicationError,
    SlotInUse,
    SlotInvalidated,
    SlotNotFound,
    invalidated_message,
)
from outboxkit.cdc.pgoutput import Begin, Commit, Message
from outboxkit.errors import MissingExtraError

if TYPE_CHECKING:
    from typing import Self

__all__ = ["Begin", "Commit", "Item", "Keepalive", "Message", "ReplicationStream", "Row"]


@dataclass(frozen=True, slots=True)
class Row:
    """A row INSERTed into a table of the publication; values in their text format."""

    relation: str  # schema.table
    values: dict[str, bytes | None]
    lsn: int


@dataclass(frozen=True, slots=True)
class Keepalive:
    """The server has sent everything before `wal_end`; only yielded between transactions."""

    wal_end: int


Item = Begin | Row | Message | Commit | Keepalive


def _psycopg2() -> Any:
    try:  # untyped (no stubs): used through Any, in this module only
        psycopg2 = importlib.import_module("psycopg2")
        for submodule in ("errors", "extensions", "extras"):
            importlib.import_module(f"psycopg2.{submodule}")
    except ModuleNotFoundError as exc:
        raise MissingExtraError(
            "the WAL relay (`--source cdc`) needs psycopg2 for PostgreSQL's replication "
            "protocol, which is not installed: pip install 'outboxkit[cdc]'"
        ) from exc
    return psycopg2


class ReplicationStream:
    """`async with ReplicationStream(dsn, slot, publication) as stream: async for item in stream`.

    Items: `Begin`, `Row` (inserts into the publication's tables), `Message`
    (`pg_logical_emit_message`), `Commit`, and `Keepalive` when idle. `confirm(lsn)` tells the
    server everything before `lsn` is done with (the slot may then free that WAL).
    """

    def __init__(
        self,
        dsn: str,
        slot: str,
        publication: str,
        *,
        status_interval: float = 10.0,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
    ) -> None:
        self.dsn = dsn
        self.slot = slot
        self.publication = publication
        self.status_interval = status_interval
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.confirmed = 0
        self._pg = _psycopg2()
        self._conn: Any = None
        self._cursor: Any = None
        self._heartbeat: asyncio.TimerHandle | None = None
        self._failure: ReplicationError | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._decoder = pgoutput.Decoder()
        self._in_transaction = False
        self._last_keepalive = 0
        self._last_data_start = 0  # of the last message read (psycopg2's last_msg_data_start)
        self._read_commit_end = 0  # end of the last commit read
        self._confirmed_changed = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> Self:
        """Connect and start streaming from the slot's confirmed position."""
        pg = self._pg
        try:
            self._conn = pg.connect(
                self.dsn,
                connection_factory=pg.extras.LogicalReplicationConnection,
                async_=True,
                connect_timeout=max(1, int(self.connect_timeout)),
            )
            await asyncio.wait_for(self._poll(), self.connect_timeout)
            self._cursor = self._conn.cursor()
            self._cursor.start_replication(
                slot_name=self.slot,
                decode=False,
                status_interval=max(1.0, self.status_interval),  # psycopg2 minimum
                options={
                    "proto_version": "1",
                    "publication_names": self.publication,
                    "messages": "true",
                },
            )
            await asyncio.wait_for(self._poll(), self.connect_timeout)
        except TimeoutError:
            self.close()
            raise ReplicationConnectionLost(
                f"no answer from PostgreSQL within {self.connect_timeout:g} s while starting "
                f"replication from slot {self.slot!r}; check the server is up and reachable"
            ) from None
        except pg.Error as exc:
            self.close()
            raise self._translate(exc) from exc
        self._arm_heartbeat()
        return self

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (the slot becomes free for another streamer)."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        conn, self._conn, self._cursor = self._conn, None, None
        if conn is not None:
            with contextlib.suppress(RuntimeError, ValueError, self._pg.Error):
                asyncio.get_running_loop().remove_reader(conn.fileno())
            conn.close()

    # -- feedback ----------------------------------------------------------------------------

    def confirm(self, lsn: int) -> None:
        """Report everything before `lsn` processed (flushed): the slot moves there."""
        if self._cursor is None:
            raise ReplicationConnectionLost("the replication stream is closed")
        if lsn <= self.confirmed:
            return
        try:
            self._cursor.send_feedback(write_lsn=lsn, flush_lsn=lsn, force=True)
        except self._pg.Error as exc:
            self._fail(self._translate(exc))
            raise self._failure from exc  # type: ignore[misc]
        self.confirmed = lsn
        self._confirmed_changed.set()

    def _keepalive_could_skip(self) -> bool:
        """True while psycopg2, reading a keepalive next, would report as flushed a
        transaction read whole but not confirmed (the module's docstring says how)."""
        return self.confirmed >= self._last_data_start and self._read_commit_end > self.confirmed

    def _arm_heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        self._heartbeat = loop.call_later(self.status_interval, self._beat)

    def _beat(self) -> None:
        """Standby status with a reply request: keeps the walsender from timing us out even
        while the caller reads nothing, and makes a live server answer (silence = lost)."""
        if self._cursor is None:
            return
        try:
            self._cursor.send_feedback(reply=True, force=True)
        except self._pg.Error as exc:
            self._fail(self._translate(exc))
            return
        self._arm_heartbeat()

    def _fail(self, error: ReplicationError) -> None:
        if self._failure is None:
            self._failure = error
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    # -- reading -----------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Item]:
        return self._items()

    async def _items(self) -> AsyncIterator[Item]:
        if self._cursor is None:
            raise ReplicationConnectionLost("the replication stream is not open: call open()")
        last_heard = time.monotonic()
        while True:
            if self._failure is not None:
                raise self._failure
            cursor = self._cursor
            if cursor is None:
                return
            if self._keepalive_could_skip():
                # Read no further until the caller confirms what it read (the heartbeat
                # keeps the connection alive meanwhile; not reading is not the server's
                # silence).
                self._confirmed_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._confirmed_changed.wait(), self.status_interval)
                last_heard = time.monotonic()
                continue
            try:
                raw = cursor.read_message()
            except self._pg.Error as exc:
                raise self._translate(exc) from exc
            if raw is not None:
                self._last_data_start = int(raw.data_start)
                item = self._item(raw.payload, raw.data_start)
                if item is not None:
                    yield item
                last_heard = time.monotonic()  # the caller's pauses are not the server's silence
                continue
            wal_end = int(cursor.wal_end)
            if not self._in_transaction and wal_end > self._last_keepalive:
                self._last_keepalive = wal_end
                yield Keepalive(wal_end)
                last_heard = time.monotonic()
                continue
            if await self._readable(wait=self.status_interval):
                last_heard = time.monotonic()
            elif time.monotonic() - last_heard > self.timeout:
                raise ReplicationConnectionLost(
                    f"PostgreSQL sent nothing on the replication connection of slot "
                    f"{self.slot!r} for {self.timeout:g} s (not even an answer to a status "
                    f"request): the connection is considered lost; reconnect"
                )

    def _item(self, payload: bytes, data_start: int) -> Item | None:
        message = self._decoder.decode(payload)
        if isinstance(message, pgoutput.Insert):
            values: dict[str, bytes | None] = {}
            for name, value in message.values.items():
                values[name] = value if isinstance(value, bytes) or value is None else None
            return Row(message.relation.qualified_name, values, data_start)
        if isinstance(message, Begin):
            self._in_transaction = True
            return message
        if isinstance(message, Commit):
            self._in_transaction = False
            self._read_commit_end = message.end_lsn
            return message
        if isinstance(message, Message):
            return message
        # Relation, Type, Origin: kept by the decoder; Update, Delete, Truncate: the
        # publication publishes inserts only, and a relay has nothing to do with them.
        return None

    async def _readable(self, *, wait: float) -> bool:
        """Wait until the socket has data (True) or `wait` seconds pass (False)."""
        loop = asyncio.get_running_loop()
        fd = self._conn.fileno()
        self._wakeup = wakeup = loop.create_future()

        def ready() -> None:
            if not wakeup.done():
                wakeup.set_result(None)

        loop.add_reader(fd, ready)
        try:
            await asyncio.wait_for(asyncio.shield(wakeup), wait)
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)
            self._wakeup = None
        return self._failure is None

    async def _poll(self) -> None:
        """Drive the asynchronous connection until its current operation completes."""
        pg = self._pg
        loop = asyncio.get_running_loop()
        while True:
            state = self._conn.poll()
            if state == pg.extensions.POLL_OK:
                return
            waiter: asyncio.Future[None] = loop.create_future()
            fd = self._conn.fileno()

            def ready(w: asyncio.Future[None] = waiter) -> None:
                if not w.done():
                    w.set_result(None)

            if state == pg.extensions.POLL_READ:
                loop.add_reader(fd, ready)
                try:
                    await waiter
                finally:
                    loop.remove_reader(fd)
            elif state == pg.extensions.POLL_WRITE:
                loop.add_writer(fd, ready)
                try:
                    await waiter
                finally:
                    loop.remove_writer(fd)

    def _translate(self, exc: BaseException) -> ReplicationError:
        """The typed error for a psycopg2 failure, saying what to do."""
        pg = self._pg
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, pg.errors.ObjectInUse):
            return SlotInUse(
                f"replication slot {self.slot!r} is streamed by another process ({text}); "
                "a standby relay waits and tries again"
            )
        if isinstance(exc, pg.errors.UndefinedObject):
            if "publication" in text:
                return SlotNotFound(
                    f"publication {self.publication!r} does not exist ({text}): run "
                    "`outboxkit cdc setup`"
                )
            return SlotNotFound(
                f"replication slot {self.slot!r} does not exist ({text}): run `outboxkit cdc "
                "setup` to create it"
            )
        if isinstance(exc, pg.errors.ObjectNotInPrerequisiteState) and (
            "invalidated" in str(exc) or "no longer get changes" in str(exc)
        ):
            table = self.slot.removeprefix("outboxkit_")
            return SlotInvalidated(f"{invalidated_message(self.slot, table)} ({text})")
        code = getattr(exc, "pgcode", None)
        # No SQLSTATE: libpq lost the connection (a server crash shows as "error with status
        # PGRES_COPY_BOTH and no message"); 08/57P: connection failure, server shut down.
        if (
            isinstance(exc, pg.OperationalError | pg.InterfaceError)
            or (code is None and type(exc) is pg.DatabaseError)
            or (code is not None and code.startswith(("08", "57P")))
        ):
            return ReplicationConnectionLost(
                f"the replication connection of slot {self.slot!r} was lost ({text}); "
                "reconnect: streaming resumes at the slot's confirmed position"
            )
        return ReplicationError(f"replication from slot {self.slot!r} failed: {text}")
