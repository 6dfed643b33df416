"""The backends the queue store contract runs on, behind one small harness each.

A scenario writes items, claims and settles them through the store interface only, and
reads an item's state back (:class:`Row`) through the harness. Time moves by
:meth:`Backend.advance`: the in-memory queue's clock moves; PostgreSQL's stored times
move back by as much (every ``available_at``, partition lease and member's expiry), which
is the same to every statement that compares them with ``now()``.

A new backend (MariaDB's) joins with one :class:`Backend` subclass here and its name in
``BACKENDS`` (conftest.py): every scenario then runs on it.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import psycopg

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.ordered_sql import OrderedStatements
from outboxkit.backends.postgres.queue_pg import PgQueueStore
from outboxkit.publishers.base import OutboundMessage
from outboxkit.queue.memory import ManualClock, MemoryQueue, MemoryQueueStore, MemoryRow
from outboxkit.queue.store import QueueStore

#: Ordered queues have this many key partitions on both backends.
PARTITIONS = 7  # not a power of two: a partition is a remainder of the hash
TOPIC = "contract"

Store = QueueStore[OutboundMessage]
StatusName = Literal["pending", "published", "failed"]
_STATUS: dict[int, StatusName] = {0: "pending", 1: "published", 2: "failed"}


@dataclasses.dataclass(frozen=True)
class Row:
    """An item's stored state; ``due_in``: seconds until ``available_at`` (lease or retry)."""

    status: StatusName
    attempts: int
    due_in: float
    claim_token: Any
    claimed_by: str | None
    last_error: str | None

    def state(self) -> tuple[Any, ...]:
        """Everything but the exact time: due or not (the backends' clocks differ by ms)."""
        return (
            self.status,
            self.attempts,
            self.claim_token,
            self.claimed_by,
            self.last_error,
            self.due_in <= 0,
        )


class Backend(abc.ABC):
    """One backend's queue (ordered or not) and the stores claiming from it."""

    name: str
    #: Scenarios this backend cannot run, by test function name: the one-line reason.
    cannot: dict[str, str] = {}

    def __init__(self, ordered: bool) -> None:
        self.ordered = ordered
        self._stores: list[Store] = []
        self._numbers: dict[uuid.UUID, int] = {}

    def number(self, item: OutboundMessage) -> int:
        """The ``n`` an item was written with (by its event id: the items a claim
        dead-letters carry no payload on PostgreSQL)."""
        return self._numbers[item.event_id]

    @abc.abstractmethod
    async def put(self, n: int = 0, *, key: str | None = None, delay: float = 0.0) -> int:
        """Write one item (payload ``{"n": n}``), due after ``delay`` seconds; its id."""

    async def put_many(self, count: int, *, key: str | None = None) -> list[int]:
        return [await self.put(n, key=key) for n in range(count)]

    def store(self, *, retention: Literal["delete", "keep"] = "delete") -> Store:
        """A new claimer on the queue (closed after the test); ordered if the queue is."""
        store = self._make_store(retention)
        self._stores.append(store)
        return store

    @abc.abstractmethod
    def _make_store(self, retention: Literal["delete", "keep"]) -> Store: ...

    @abc.abstractmethod
    async def row(self, item_id: int) -> Row | None:
        """The item's state; None once it was deleted."""

    @abc.abstractmethod
    async def table(self) -> dict[int, Row]:
        """Every item's state by id (published ones only under retention keep)."""

    @abc.abstractmethod
    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for every lease, retry time and partition lease."""

    @abc.abstractmethod
    async def hold_partitions(
        self, owner: str, lease: float = 60.0, wanted: Sequence[int] = range(PARTITIONS)
    ) -> list[int]:
        """Give ``owner`` the lease on the free ones of ``wanted`` and renew its own (ordered
        mode's membership); the partitions it holds of them, sorted."""

    @abc.abstractmethod
    async def heartbeat(self, relay_id: str, lease: float) -> list[str]:
        """Renew ``relay_id``'s membership (ordered mode); the live members, sorted."""

    @abc.abstractmethod
    async def leave(self, relay_id: str) -> None:
        """``relay_id`` leaves the membership."""

    async def close(self) -> None:
        for store in self._stores:
            await store.close()


class MemoryBackend(Backend):
    name = "memory"

    def __init__(self, ordered: bool, clock: ManualClock | None = None) -> None:
        super().__init__(ordered)
        self.clock = clock or ManualClock(1_000.0)
        self.queue: MemoryQueue[OutboundMessage] = MemoryQueue(
            clock=self.clock, partitions=PARTITIONS if ordered else None
        )

    async def put(self, n: int = 0, *, key: str | None = None, delay: float = 0.0) -> int:
        event = Event(topic=TOPIC, event_type="contract.item", payload={"n": n}, key=key)
        self._numbers[event.event_id] = n
        message = OutboundMessage(
            event.event_id,
            event.topic,
            event.key,
            event.event_type,
            None,
            None,
            event.payload,
            {},
            dt.datetime.now(dt.UTC),
        )
        return self.queue.put(message, key=key, delay=delay)

    def _make_store(self, retention: Literal["delete", "keep"]) -> Store:
        return MemoryQueueStore(
            self.queue,
            lambda message, attempt: dataclasses.replace(message, attempt=attempt),
            retention=retention,
            ordered=self.ordered,
        )

    async def row(self, item_id: int) -> Row | None:
        r = self.queue.row(item_id)
        return None if r is None else self._row(r)

    async def table(self) -> dict[int, Row]:
        return {r.id: self._row(r) for r in self.queue.rows()}

    def _row(self, r: MemoryRow[OutboundMessage]) -> Row:
        return Row(
            _STATUS[int(r.status)],
            r.attempts,
            r.available_at - self.clock(),
            r.claim_token,
            r.claimed_by,
            r.last_error,
        )

    async def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    async def hold_partitions(
        self, owner: str, lease: float = 60.0, wanted: Sequence[int] = range(PARTITIONS)
    ) -> list[int]:
        return self.queue.acquire_partitions(owner, wanted, lease)

    async def heartbeat(self, relay_id: str, lease: float) -> list[str]:
        return self.queue.relay_heartbeat(relay_id, lease)

    async def leave(self, relay_id: str) -> None:
        self.queue.leave(relay_id)


class PostgresBackend(Backend):
    name = "postgres"

    def __init__(self, dsn: str, ordered: bool) -> None:
        super().__init__(ordered)
        self.dsn = dsn
        self.outbox = Outbox()
        self.conn = psycopg.connect(dsn, autocommit=True)
        if ordered:
            migrate(dsn, ordered=True, partitions=PARTITIONS)

    async def put(self, n: int = 0, *, key: str | None = None, delay: float = 0.0) -> int:
        event = Event(
            topic=TOPIC,
            event_type="contract.item",
            payload={"n": n},
            key=key,
            delay=dt.timedelta(seconds=delay) if delay else None,
        )
        self._numbers[event.event_id] = n
        with psycopg.connect(self.dsn) as conn:
            self.outbox.put(conn, event)
        row = self.conn.execute(
            "SELECT id FROM outbox WHERE event_id = %s", (event.event_id,)
        ).fetchone()
        assert row is not None
        return int(row[0])

    def _make_store(self, retention: Literal["delete", "keep"]) -> Store:
        store: Store = PgQueueStore(
            self.dsn, "outbox", OutboundMessage, retention=retention, ordered=self.ordered
        )
        return store

    _COLUMNS = (
        "id, status, attempts, extract(epoch FROM available_at - now())::float8,"
        " claim_token, claimed_by, last_error"
    )

    async def row(self, item_id: int) -> Row | None:
        r = self.conn.execute(
            f"SELECT {self._COLUMNS} FROM outbox WHERE id = %s", (item_id,)
        ).fetchone()
        return None if r is None else Row(_STATUS[r[1]], *r[2:])

    async def table(self) -> dict[int, Row]:
        rows = self.conn.execute(f"SELECT {self._COLUMNS} FROM outbox ORDER BY id").fetchall()
        return {r[0]: Row(_STATUS[r[1]], *r[2:]) for r in rows}

    async def advance(self, seconds: float) -> None:
        shift = "make_interval(secs => %s)"
        self.conn.execute(
            f"UPDATE outbox SET available_at = available_at - {shift},"
            f" created_at = created_at - {shift}",
            (seconds, seconds),
        )
        if self.ordered:
            for table in ("outbox_partitions", "outbox_relays"):
                self.conn.execute(
                    f"UPDATE {table} SET expires_at = expires_at - {shift}", (seconds,)
                )

    async def hold_partitions(
        self, owner: str, lease: float = 60.0, wanted: Sequence[int] = range(PARTITIONS)
    ) -> list[int]:
        params = {"relay_id": owner, "lease": lease, "wanted": list(wanted)}
        cur = self.conn.execute(OrderedStatements().acquire_partitions, params)
        return sorted(r[0] for r in cur.fetchall())

    async def heartbeat(self, relay_id: str, lease: float) -> list[str]:
        params = {"relay_id": relay_id, "lease": lease}
        cur = self.conn.execute(OrderedStatements().relay_heartbeat, params)
        return [r[0] for r in cur.fetchall()]

    async def leave(self, relay_id: str) -> None:
        self.conn.execute(OrderedStatements().leave, {"relay_id": relay_id})

    async def close(self) -> None:
        await super().close()
        self.conn.close()


#: Ordered MariaDB databases emptied after their scenario, by server port (a session's).
_ORDERED_SPARE: dict[int, list[str]] = {}


class MariaDBBackend(Backend):
    """A database of its own on the private MariaDB, ordered or not (dropped at close;
    an ordered one is emptied and reused by the next ordered scenario)."""

    name = "mariadb"
    # (No LISTEN/NOTIFY: the wake-up gate is in-process, backends/mariadb/wakeup.py; the
    # items are written with transaction(), whose COMMIT outboxkit sees.)

    def __init__(self, server: Any, ordered: bool) -> None:
        import pymysql

        from outboxkit.backends.mariadb.migrate import migrate as mariadb_migrate

        super().__init__(ordered)
        self.admin = pymysql.connect(**server.connect_args(), autocommit=True)
        spare = _ORDERED_SPARE.get(server.port) if ordered else None
        if spare:  # an emptied ordered database of an earlier scenario (migrating takes ~2 s)
            self.database = spare.pop()
            self.url = server.url_for(self.database)
        else:
            self.database = f"contract_{uuid.uuid4().hex[:12]}"
            with self.admin.cursor() as cur:
                cur.execute(f"CREATE DATABASE {self.database}")
            self.url = server.url_for(self.database)
            if ordered:
                mariadb_migrate(self.url, kind="ordered", partitions=PARTITIONS)
            else:
                mariadb_migrate(self.url)
        self.server_port = server.port
        self.conn = pymysql.connect(
            **server.connect_args(self.database),
            autocommit=True,
            client_flag=pymysql.constants.CLIENT.MULTI_STATEMENTS,
        )
        self.outbox = Outbox(storage="mariadb", ordered=ordered)

    async def put(self, n: int = 0, *, key: str | None = None, delay: float = 0.0) -> int:
        event = Event(
            topic=TOPIC,
            event_type="contract.item",
            payload={"n": n},
            key=key,
            delay=dt.timedelta(seconds=delay) if delay else None,
        )
        self._numbers[event.event_id] = n
        with self.outbox.transaction(self.conn) as tx:
            tx.put(event)
        with self.conn.cursor() as cur:
            cur.execute("SELECT id FROM outbox WHERE event_id = %s", (str(event.event_id),))
            return int(cur.fetchone()[0])

    def _make_store(self, retention: Literal["delete", "keep"]) -> Store:
        from outboxkit.backends.mariadb.queue import MariaDBQueueStore

        store: Store = MariaDBQueueStore(
            self.url, "outbox", OutboundMessage, retention=retention, ordered=self.ordered
        )
        return store

    _COLUMNS = (
        "id, status, attempts,"
        " TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), available_at) / 1e6,"
        " claim_token, claimed_by, last_error"
    )

    def _row(self, r: Any) -> Row:
        token = None if r[4] is None else uuid.UUID(r[4])
        return Row(_STATUS[r[1]], r[2], float(r[3]), token, r[5], r[6])

    async def row(self, item_id: int) -> Row | None:
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT {self._COLUMNS} FROM outbox WHERE id = %s", (item_id,))
            r = cur.fetchone()
        return None if r is None else self._row(r)

    async def table(self) -> dict[int, Row]:
        with self.conn.cursor() as cur:
            cur.execute(f"SELECT {self._COLUMNS} FROM outbox ORDER BY id")
            return {r[0]: self._row(r) for r in cur.fetchall()}

    async def advance(self, seconds: float) -> None:
        shift = "INTERVAL %s MICROSECOND"
        with self.conn.cursor() as cur:
            cur.execute(
                f"UPDATE outbox SET available_at = available_at - {shift},"
                f" created_at = created_at - {shift}",
                (round(seconds * 1e6), round(seconds * 1e6)),
            )
            if self.ordered:
                for table in ("outbox_partitions", "outbox_relays"):
                    cur.execute(
                        f"UPDATE {table} SET expires_at = expires_at - {shift}",
                        (round(seconds * 1e6),),
                    )

    def _sql(self) -> Any:
        from outboxkit.backends.mariadb.ordered_sql import OrderedStatements

        return OrderedStatements("outbox")

    async def hold_partitions(
        self, owner: str, lease: float = 60.0, wanted: Sequence[int] = range(PARTITIONS)
    ) -> list[int]:
        from outboxkit.backends.mariadb.ordered_sql import expand

        o, parts, micros = self._sql(), list(wanted), round(lease * 1e6)
        with self.conn.cursor() as cur:
            cur.execute(
                expand(o.acquire_partitions, parts=len(parts)),
                (owner, owner, micros, *parts, owner),
            )
            cur.execute(expand(o.held_partitions, parts=len(parts)), (*parts, owner))
            return sorted(r[0] for r in cur.fetchall())

    async def heartbeat(self, relay_id: str, lease: float) -> list[str]:
        o, micros = self._sql(), round(lease * 1e6)
        with self.conn.cursor() as cur:
            cur.execute(o.relay_beat, (relay_id, micros))
            cur.execute(o.forget_relays, (10 * micros,))
            cur.execute(o.live_relays)
            return [r[0] for r in cur.fetchall()]

    async def leave(self, relay_id: str) -> None:
        with self.conn.cursor() as cur:
            cur.execute(self._sql().leave, (relay_id,))

    async def close(self) -> None:
        await super().close()
        if self.ordered:  # emptied and kept for the next ordered scenario
            with self.conn.cursor() as cur:
                cur.execute("TRUNCATE TABLE outbox")
                cur.execute(
                    "UPDATE outbox_partitions SET owner = NULL, epoch = 0, expires_at = NULL"
                )
                cur.execute("DELETE FROM outbox_relays")
            _ORDERED_SPARE.setdefault(self.server_port, []).append(self.database)
        else:
            with self.admin.cursor() as cur:
                cur.execute(f"DROP DATABASE {self.database}")
        self.conn.close()
        self.admin.close()
