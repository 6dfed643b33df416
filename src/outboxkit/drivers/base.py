"""The adapter interface every driver implements, and the registry that picks one.

``Outbox`` and ``Inbox`` never test a connection's type themselves: they ask
:func:`sync_adapter` / :func:`async_adapter`, which resolve the connection's type
once (cached per type) to the adapter of its driver. An adapter refuses to run
outside an open transaction (the write and the inbox record must commit with the
caller's change) and runs a statement in its driver's parameter style.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

from outboxkit.errors import NotInTransactionError


class Statement(NamedTuple):
    """One statement in both parameter styles: ``%s`` (psycopg, DB-API) and ``$n`` (asyncpg)."""

    text: str
    dollar: str


class CursorCache:
    """One reusable psycopg cursor, for the connection it was made on.

    ``conn.execute()`` builds a cursor and looks up the parameter dumpers on every
    call (~10 % of a write's cost, docs/benchmarks.md). The (connection, cursor)
    pair is swapped atomically, so sharing the owner across threads costs at most
    a new cursor, never a wrong one.
    """

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: tuple[Any, Any] | None = None


@dataclass(frozen=True, slots=True)
class Use:
    """Who is asking, so that a refusal names the caller's own methods."""

    action: str  # "write an outbox event"
    inside: str  # "write inside its transaction"
    sync_methods: str  # "put()/put_many()"
    async_methods: str  # "`await aput()`/`aput_many()`"


def type_name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class Adapter:
    """What every adapter declares about the connection types it takes."""

    #: How error messages name what this adapter accepts, e.g. "psycopg.Connection".
    label: ClassVar[str]
    #: Module prefixes of this kind's (sync or async) objects, beyond what ``handles``
    #: takes: an error then names the caller's methods of the other kind.
    modules: ClassVar[tuple[str, ...]]

    #: The database the driver speaks to: "postgresql" or "mariadb" (MariaDB/MySQL).
    backend: ClassVar[str] = "postgresql"

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        raise NotImplementedError

    @classmethod
    def refusal(cls, conn_type: type) -> str | None:
        """Why an object of this driver that is not a transaction is refused (a pool...)."""
        return None


class SyncAdapter(Adapter):
    """A sync driver: every method checks that ``conn`` is inside a transaction first."""

    def check(self, conn: Any) -> None:
        raise NotImplementedError

    def execute(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        raise NotImplementedError

    def fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        """The first column of the first row (None without a row)."""
        raise NotImplementedError

    def fetch_flag(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> bool:
        """:meth:`fetch_value` as a bool (False without a row)."""
        return bool(self.fetch_value(conn, stmt, params))

    # A driver connection used under a wrapper (SQLAlchemy) that owns the transaction:
    # the wrapper has checked it, so these only run (``joins`` says whether they can).
    def joins(self, conn: Any) -> bool:
        return False

    def run(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        raise NotImplementedError

    def run_fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        raise NotImplementedError


class AsyncAdapter(Adapter):
    """:class:`SyncAdapter` for async drivers."""

    def check(self, conn: Any) -> None:
        raise NotImplementedError

    async def execute(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        raise NotImplementedError

    async def fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        raise NotImplementedError

    async def fetch_flag(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> bool:
        return bool(await self.fetch_value(conn, stmt, params))

    def joins(self, conn: Any) -> bool:
        return False

    async def run(
        self, conn: Any, stmt: Statement, params: Sequence[Any], cursors: CursorCache | None
    ) -> None:
        raise NotImplementedError

    async def run_fetch_value(self, conn: Any, stmt: Statement, params: Sequence[Any]) -> Any:
        raise NotImplementedError


_SYNC: list[SyncAdapter] = []
_ASYNC: list[AsyncAdapter] = []
_SYNC_BY_TYPE: dict[type, SyncAdapter | None] = {}
_ASYNC_BY_TYPE: dict[type, AsyncAdapter | None] = {}


def register(adapter: SyncAdapter | AsyncAdapter) -> None:
    """Add a driver; the first registered adapter that handles a type wins."""
    if isinstance(adapter, SyncAdapter):
        _SYNC.append(adapter)
    else:
        _ASYNC.append(adapter)
    _SYNC_BY_TYPE.clear()
    _ASYNC_BY_TYPE.clear()


def sync_adapter(conn: Any, use: Use) -> SyncAdapter:
    """The adapter for ``conn``'s driver; refuses what cannot hold a transaction."""
    try:
        adapter = _SYNC_BY_TYPE[type(conn)]
    except KeyError:
        adapter = _SYNC_BY_TYPE[type(conn)] = _find(_SYNC, type(conn))
    if adapter is None:
        raise _unsupported(conn, use, async_api=False)
    return adapter


def async_adapter(conn: Any, use: Use) -> AsyncAdapter:
    """:func:`sync_adapter` for the async API."""
    try:
        adapter = _ASYNC_BY_TYPE[type(conn)]
    except KeyError:
        adapter = _ASYNC_BY_TYPE[type(conn)] = _find(_ASYNC, type(conn))
    if adapter is None:
        raise _unsupported(conn, use, async_api=True)
    return adapter


def raw_sync_adapter(conn: Any) -> SyncAdapter | None:
    """The adapter of a driver connection under a wrapper, or None (generic DB-API)."""
    try:
        return _SYNC_BY_TYPE[type(conn)]
    except KeyError:
        adapter = _SYNC_BY_TYPE[type(conn)] = _find(_SYNC, type(conn))
        return adapter


def raw_async_adapter(conn: Any) -> AsyncAdapter | None:
    try:
        return _ASYNC_BY_TYPE[type(conn)]
    except KeyError:
        adapter = _ASYNC_BY_TYPE[type(conn)] = _find(_ASYNC, type(conn))
        return adapter


_A = TypeVar("_A", bound=Adapter)


def _find(adapters: list[_A], conn_type: type) -> _A | None:
    return next((a for a in adapters if a.handles(conn_type)), None)


def _unsupported(conn: Any, use: Use, *, async_api: bool) -> Exception:
    cls = type(conn)
    for adapter in (*_SYNC, *_ASYNC):
        if (reason := adapter.refusal(cls)) is not None:
            return NotInTransactionError(reason)
    name = type_name(conn)
    if "pool" in name.lower():
        return NotInTransactionError(
            f"got a connection pool ({name}); take a connection and {use.inside}"
        )
    mine, other = (_ASYNC, _SYNC) if async_api else (_SYNC, _ASYNC)
    labels = [a.label for a in mine]
    hint = labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} or {labels[-1]}"
    if any(a.handles(cls) or cls.__module__.startswith(a.modules) for a in other):
        if async_api:
            hint += f" (this is a sync connection: use {use.sync_methods})"
        else:
            hint += f" (this is an async connection: use {use.async_methods})"
    return TypeError(f"cannot {use.action} through {name}; expected {hint}")


def for_paramstyle(paramstyle: str, stmt: Statement) -> str:
    """The statement's text for a DB-API driver's ``paramstyle``."""
    if paramstyle in ("format", "pyformat"):
        return stmt.text
    if paramstyle == "numeric_dollar":
        return stmt.dollar
    raise NotImplementedError(f"unsupported DB-API paramstyle {paramstyle!r}")


def dbapi_params(params: Sequence[Any]) -> tuple[Any, ...]:
    """Parameters for a generic DB-API driver (psycopg2): UUIDs as text, which casts fine."""
    return tuple(
        str(p)
        if isinstance(p, uuid.UUID)
        else [str(u) for u in p]
        if isinstance(p, list) and p and isinstance(p[0], uuid.UUID)
        else p
        for p in params
    )


def dbapi_autocommit(dbapi_conn: Any, original: Any) -> None:
    """Refuse a DB-API connection in autocommit mode (each statement commits alone)."""
    autocommit = getattr(dbapi_conn, "autocommit", False)
    if callable(autocommit):  # the MySQL drivers: autocommit(on) sets it, get_autocommit() reads
        autocommit = dbapi_conn.get_autocommit()
    if autocommit:
        raise NotInTransactionError(
            f"{type_name(original)} runs with isolation_level='AUTOCOMMIT';"
            " each statement would commit on its own, so the event could not be atomic"
            " with your change"
        )
