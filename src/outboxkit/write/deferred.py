"""Events queued in the caller's transaction and written with its COMMIT.

``Outbox.transaction()`` sends the INSERTs with the COMMIT, but only around a block it owns.
ORMs own the COMMIT themselves (a SQLAlchemy ``Session``, Django's ``atomic()``): there the
events are checked and queued (:class:`Pending`), dropped with a rollback (or with a rollback
to a savepoint taken before them), and handed to :func:`write_with_commit` by a hook at the
one place the ORM sends its COMMIT. On psycopg 3 that is ``Outbox.transaction()``'s
pipeline: no round trip of their own. Elsewhere (asyncpg, psycopg2) one ``put_many`` per
outbox just before the COMMIT: one round trip for all of the transaction's events.

The SQLAlchemy hook (:func:`defer`, :func:`adefer`): the dialect's ``do_commit``,
``do_rollback`` and savepoint methods, wrapped on the dialect instance by an engine's first
deferred write (the queue lives on the pool's connection proxy of the transaction, one per
checkout). ``do_commit`` runs after the Session's flush and sends the DBAPI ``commit()``;
psycopg's ``commit()`` on a connection the pipeline already committed sends nothing. Every
``Session``, ``Connection`` and their async twins commit through it. The Django hook is
``contrib/django/deferred.py``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import psycopg

from outboxkit.drivers.asyncpg_adapter import Asyncpg
from outboxkit.errors import NotInTransactionError
from outboxkit.events import Event
from outboxkit.write.storage import Check, encode_batch


class Writer(Protocol):
    """What a synchronous COMMIT hook needs of what it writes (an ``Outbox``, or Django's
    task writer): kept as a protocol, ``outbox`` imports this."""

    def transaction(self, conn: psycopg.Connection[Any]) -> Any: ...
    def put_many(self, conn: Any, events: Iterable[Event]) -> None: ...


class AsyncWriter(Writer, Protocol):
    """A :class:`Writer` that also writes on async drivers (SQLAlchemy's async engines)."""

    def atransaction(self, conn: psycopg.AsyncConnection[Any]) -> Any: ...
    async def aput(self, conn: Any, event: Event) -> None: ...
    async def aput_many(self, conn: Any, events: Iterable[Event]) -> None: ...


W = TypeVar("W", bound=Writer)


@dataclass
class Queued(Generic[W]):
    outbox: W
    events: list[Event]


@dataclass
class Pending(Generic[W]):
    """The events of one connection's open transaction, not sent yet."""

    raw: Any = None  # the driver connection they were queued on
    queued: list[Queued[W]] = field(default_factory=list)
    #: Each savepoint taken since the first deferred write: its name and how many
    #: entries were queued when it was taken, innermost last.
    marks: list[tuple[str | None, int]] = field(default_factory=list)
    owner: Any = None  # what queued them (a SQLAlchemy Connection), for the fallback write

    def add(self, raw: Any, outbox: W, events: list[Event]) -> None:
        if self.raw is not raw:  # a reconnect: what the old connection had is gone
            self.take(None)
            self.raw = raw
        self.queued.append(Queued(outbox, events))

    def take(self, raw: Any) -> list[Queued[W]]:
        """Everything queued on ``raw`` (a reconnect drops what the old connection had)."""
        found = self.queued if raw is self.raw else []
        self.queued, self.raw, self.marks, self.owner = [], None, [], None
        return found

    def mark(self, name: str | None) -> None:
        """A savepoint is taken (``None``: a name not known yet, see :meth:`_find`)."""
        self.marks.append((name, len(self.queued)))

    def roll_back_to(self, name: str) -> None:
        """Drop what was queued since savepoint ``name`` (all of it for one taken before the
        first deferred write: it is not marked); the savepoint itself stays."""
        index = self._find(name)
        if index is None:
            self.queued.clear()
            self.marks.clear()
            return
        del self.queued[self.marks[index][1] :]
        del self.marks[index + 1 :]

    def release(self, name: str) -> None:
        """Savepoint ``name`` (and every one taken after it) is gone; its events stay."""
        index = self._find(name)
        if index is not None:
            del self.marks[index:]

    def _find(self, name: str) -> int | None:
        for i in range(len(self.marks) - 1, -1, -1):
            if self.marks[i][0] == name:
                return i
        # A savepoint whose name was not known when it was taken is the innermost one
        # still unnamed (savepoints nest: SQLAlchemy's and Django's are released or rolled
        # back innermost first).
        for i in range(len(self.marks) - 1, -1, -1):
            if self.marks[i][0] is None:
                self.marks[i] = (name, self.marks[i][1])
                return i
        return None


def checked(events: Iterable[Event], check: Check) -> list[Event]:
    """``events`` checked now (a bad event fails at the call, not at COMMIT)."""
    return encode_batch(events, check, lambda e: e)


def write_with_commit(raw: psycopg.Connection[Any], queued: Sequence[Queued[W]]) -> None:
    """The queued events' INSERTs and the COMMIT, in one pipeline (``Outbox.transaction``)."""
    last = queued[-1].outbox
    for q in queued:
        if q.outbox is not last:  # several outboxes in one transaction: plain INSERTs first
            q.outbox.put_many(raw, q.events)
    with last.transaction(raw) as tx:
        for q in queued:
            if q.outbox is last:
                tx.put_many(q.events)


async def awrite_with_commit(
    raw: psycopg.AsyncConnection[Any], queued: list[Queued[AsyncWriter]]
) -> None:
    """:func:`write_with_commit` for psycopg ``AsyncConnection``."""
    last = queued[-1].outbox
    for q in queued:
        if q.outbox is not last:
            await q.outbox.aput_many(raw, q.events)
    async with last.atransaction(raw) as tx:
        for q in queued:
            if q.outbox is last:
                tx.put_many(q.events)


# -- SQLAlchemy -------------------------------------------------------------------------

_ATTRIBUTE = "_outboxkit_pending"
_hooked: weakref.WeakSet[Any] = weakref.WeakSet()
_hooking = threading.Lock()  # two threads' first defer on one engine: one set of listeners


def defer(conn: Any, outbox: AsyncWriter, events: list[Event]) -> None:
    """Queue checked ``events`` for the COMMIT of ``conn`` (a SQLAlchemy Session/Connection)."""
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    if not isinstance(conn, Session | Connection):
        raise _unsupported(conn, "defer", "a SQLAlchemy Session or Connection")
    from outboxkit.drivers.sqlalchemy_adapter import SQLAlchemySync

    sa = SQLAlchemySync().transaction_connection(conn)
    _queue(sa, outbox, events)


async def adefer(conn: Any, outbox: AsyncWriter, events: list[Event]) -> None:
    """:func:`defer` for a SQLAlchemy ``AsyncSession``/``AsyncConnection``."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if not isinstance(conn, AsyncSession | AsyncConnection):
        raise _unsupported(conn, "adefer", "a SQLAlchemy AsyncSession or AsyncConnection")
    from outboxkit.drivers.sqlalchemy_adapter import SQLAlchemyAsync

    sa = await SQLAlchemyAsync().transaction_connection(conn)
    _queue(sa, outbox, events)


def _queue(sa: Any, outbox: AsyncWriter, events: list[Event]) -> None:
    from sqlalchemy.engine import TwoPhaseTransaction

    if isinstance(sa.get_transaction(), TwoPhaseTransaction):
        # Its COMMIT PREPARED goes through do_commit_twophase: the events would be lost.
        raise NotInTransactionError(
            "Outbox.defer() cannot write with a two-phase transaction's commit; use"
            " outbox.put(session, event) there"
        )
    if not events:
        return
    dialect = sa.dialect
    if dialect not in _hooked:
        with _hooking:
            if dialect not in _hooked:
                _hook(dialect)
    fairy = sa.connection  # the pool's proxy of the DBAPI connection, one per checkout
    pending: Pending[AsyncWriter] | None = fairy.__dict__.get(_ATTRIBUTE)
    if pending is None:
        pending = fairy.__dict__[_ATTRIBUTE] = Pending()
    pending.add(fairy.dbapi_connection, outbox, events)
    pending.owner = sa


def _hook(dialect: Any) -> None:
    """Wrap the dialect's commit, rollback and savepoint methods (on this instance only).

    Not SQLAlchemy's ConnectionEvents: a listener on an engine makes every statement of
    that engine dispatch its execute events, ~0.2 ms of client CPU per ORM transaction
    (measured), deferred or not; these run once per commit, rollback or savepoint.
    """
    commit, rollback = dialect.do_commit, dialect.do_rollback
    savepoint = dialect.do_savepoint
    to_savepoint, release = dialect.do_rollback_to_savepoint, dialect.do_release_savepoint

    def do_commit(dbapi_connection: Any) -> None:
        pending = _pending(dbapi_connection)
        if pending is not None and pending.queued:
            _write(dbapi_connection, pending)
        commit(dbapi_connection)

    def do_rollback(dbapi_connection: Any) -> None:
        pending = _pending(dbapi_connection)
        if pending is not None:
            pending.take(None)
        rollback(dbapi_connection)

    def do_savepoint(connection: Any, name: str) -> None:
        pending = _pending(connection.connection)
        if pending is not None:
            pending.mark(name)
        savepoint(connection, name)

    def do_rollback_to_savepoint(connection: Any, name: str) -> None:
        pending = _pending(connection.connection)
        if pending is not None:
            pending.roll_back_to(name)
        to_savepoint(connection, name)

    def do_release_savepoint(connection: Any, name: str) -> None:
        pending = _pending(connection.connection)
        if pending is not None:
            pending.release(name)
        release(connection, name)

    dialect.do_commit, dialect.do_rollback = do_commit, do_rollback
    dialect.do_savepoint = do_savepoint
    dialect.do_rollback_to_savepoint = do_rollback_to_savepoint
    dialect.do_release_savepoint = do_release_savepoint
    _hooked.add(dialect)


def _pending(fairy: Any) -> Pending[AsyncWriter] | None:
    found = getattr(fairy, "__dict__", None)
    return None if found is None else found.get(_ATTRIBUTE)


def _write(fairy: Any, pending: Pending[AsyncWriter]) -> None:
    """The queued events, written before (on psycopg: with) the COMMIT."""
    sa = pending.owner
    queued = pending.take(fairy.dbapi_connection)
    if not queued:
        return
    raw = fairy.driver_connection
    if isinstance(raw, psycopg.Connection):
        write_with_commit(raw, queued)
    elif isinstance(raw, psycopg.AsyncConnection):
        _await(awrite_with_commit(raw, queued))
    elif Asyncpg.handles(type(raw)) and raw.is_in_transaction():
        # asyncpg has no pipeline to ride in (its COMMIT is its Transaction's own query):
        # one statement per outbox just before it, on the driver connection.
        for outbox, events in _by_outbox(queued):
            if len(events) == 1:  # put's statement: no arrays to adapt (cheaper than unnest)
                _await(outbox.aput(raw, events[0]))
            else:
                _await(outbox.aput_many(raw, events))
    else:
        # Other DB-API drivers (psycopg2), or asyncpg before SQLAlchemy's adapter began
        # (nothing else ran): the same, through SQLAlchemy's connection, which begins.
        for outbox, events in _by_outbox(queued):
            outbox.put_many(sa, events)


def _by_outbox(queued: list[Queued[AsyncWriter]]) -> list[tuple[AsyncWriter, list[Event]]]:
    """The queued events grouped by outbox, in the order each outbox first queued."""
    groups: dict[int, tuple[AsyncWriter, list[Event]]] = {}
    for q in queued:
        groups.setdefault(id(q.outbox), (q.outbox, []))[1].extend(q.events)
    return list(groups.values())


def _await(awaitable: Any) -> None:
    """Run ``awaitable`` from SQLAlchemy's sync code under an async engine (its greenlet)."""
    from sqlalchemy.util import concurrency

    run: Callable[[Any], Any] = getattr(concurrency, "await_", None) or concurrency.await_only
    run(awaitable)


def _unsupported(conn: object, method: str, expected: str) -> Exception:
    from outboxkit.drivers import type_name

    return TypeError(
        f"Outbox.{method}() needs {expected}, got {type_name(conn)}; with psycopg use"
        " `with outbox.transaction(conn) as tx: tx.put(...)`, elsewhere put()/aput()"
    )
