"""Write overhead: the reference business transaction with and without the outbox write.

Every write path the library offers (psycopg sync and async, asyncpg,
SQLAlchemy sync and async) is measured against its own plain baseline: the
same transaction through the same driver without the outbox write. Within a
path the variants are interleaved per transaction in a fresh random order each
round, with an A/A control (the plain transaction against itself) so the
machine's noise is visible next to the effect. Paths take turns in blocks of
rounds. Each variant gets its median, its overhead against the baseline and a
95 % confidence interval of that ratio (bootstrap over rounds, paired). Prints
a table and writes JSON.

    python bench/write_overhead.py --dsn postgresql://postgres@127.0.0.1/bench
    OUTBOXKIT_BENCH_WRITE_ROUNDS=20000 python bench/write_overhead.py --dsn ...   # longer

The reference transaction (issue 5): insert an order, insert 3 order lines,
update 3 stock rows, commit; ``synchronous_commit=on``; one connection. The
``sqlalchemy-orm*`` paths write it through the ORM (``orm_business``) and set
``outbox.defer``/``adefer`` (queued, written with the COMMIT) beside ``put``/``aput``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import psycopg
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from outboxkit import Event, Outbox
from outboxkit.backends.postgres.migrate import migrate
from outboxkit.backends.postgres.postgres import Statements
from outboxkit.write.commit import _pipeline as commit_pipeline

SCHEMA = """
DROP TABLE IF EXISTS bench_order_lines, bench_orders, bench_stock;
CREATE TABLE bench_orders (id bigserial PRIMARY KEY, customer text NOT NULL,
                           total_cents int NOT NULL, created_at timestamptz DEFAULT now());
CREATE TABLE bench_order_lines (id bigserial PRIMARY KEY, order_id bigint NOT NULL,
                                sku int NOT NULL, qty int NOT NULL);
CREATE TABLE bench_stock (sku int PRIMARY KEY, qty int NOT NULL);
INSERT INTO bench_stock SELECT g, 1000000000 FROM generate_series(1, 1000) g;
"""
TARGET_PCT = 2.0
AA_TOLERANCE_PCT = 1.0
BLOCK_ROUNDS = 250  # paths take turns every this many rounds
WARMUP_ROUNDS = 100  # per path: prepared statements, caches, connection state
BOOTSTRAP_RESAMPLES = 500
PAYLOAD = {"order": 1, "customer": "customer-1", "lines": [1, 2, 3], "total_cents": 4200}

# The business statements in each driver's parameter style.
NEW_ORDER = "INSERT INTO bench_orders (customer, total_cents) VALUES (%s, %s) RETURNING id"
NEW_LINE = "INSERT INTO bench_order_lines (order_id, sku, qty) VALUES (%s, %s, %s)"
TAKE_STOCK = "UPDATE bench_stock SET qty = qty - 1 WHERE sku = %s"
PG_NEW_ORDER = "INSERT INTO bench_orders (customer, total_cents) VALUES ($1, $2) RETURNING id"
PG_NEW_LINE = "INSERT INTO bench_order_lines (order_id, sku, qty) VALUES ($1, $2, $3)"
PG_TAKE_STOCK = "UPDATE bench_stock SET qty = qty - 1 WHERE sku = $1"
SA_NEW_ORDER = sa.text(
    "INSERT INTO bench_orders (customer, total_cents) VALUES (:c, :t) RETURNING id"
)
SA_NEW_LINE = sa.text("INSERT INTO bench_order_lines (order_id, sku, qty) VALUES (:o, :s, :q)")
SA_TAKE_STOCK = sa.text("UPDATE bench_stock SET qty = qty - 1 WHERE sku = :s")

SyncTx = Callable[[], None]
AsyncTx = Callable[[], Awaitable[None]]


class Order:
    """The random inputs of one business transaction (drawn outside the timed section)."""

    __slots__ = ("customer", "skus", "total")

    def __init__(self, rng: random.Random) -> None:
        self.customer = f"customer-{rng.randrange(1000)}"
        self.total = rng.randrange(100, 100000)
        self.skus = rng.sample(range(1, 1001), 3)


def order_event(order_id: int) -> Event:
    return Event(topic="orders", event_type="order.placed", key=str(order_id), payload=PAYLOAD)


# -- the transaction, per driver ----------------------------------------------------


def psycopg_business(conn: psycopg.Connection[Any], o: Order) -> int:
    row = conn.execute(NEW_ORDER, (o.customer, o.total)).fetchone()
    assert row is not None
    order_id = int(row[0])
    for sku in o.skus:
        conn.execute(NEW_LINE, (order_id, sku, 1))
    for sku in sorted(o.skus):
        conn.execute(TAKE_STOCK, (sku,))
    return order_id


def psycopg_business_attached(conn: psycopg.Connection[Any], o: Order, ob: Outbox) -> int:
    """The transaction with the event attached to the first order line's INSERT."""
    row = conn.execute(NEW_ORDER, (o.customer, o.total)).fetchone()
    assert row is not None
    order_id = int(row[0])
    first, *others = o.skus
    ob.execute_with(conn, NEW_LINE, (order_id, first, 1), events=[order_event(order_id)])
    for sku in others:
        conn.execute(NEW_LINE, (order_id, sku, 1))
    for sku in sorted(o.skus):
        conn.execute(TAKE_STOCK, (sku,))
    return order_id


async def psycopg_async_business_attached(
    conn: psycopg.AsyncConnection[Any], o: Order, ob: Outbox
) -> int:
    cur = await conn.execute(NEW_ORDER, (o.customer, o.total))
    row = await cur.fetchone()
    assert row is not None
    order_id = int(row[0])
    first, *others = o.skus
    await ob.aexecute_with(conn, NEW_LINE, (order_id, first, 1), events=[order_event(order_id)])
    for sku in others:
        await conn.execute(NEW_LINE, (order_id, sku, 1))
    for sku in sorted(o.skus):
        await conn.execute(TAKE_STOCK, (sku,))
    return order_id


async def asyncpg_business_attached(conn: asyncpg.Connection, o: Order, ob: Outbox) -> int:
    order_id = int(await conn.fetchval(PG_NEW_ORDER, o.customer, o.total))
    first, *others = o.skus
    await ob.aexecute_with(conn, PG_NEW_LINE, (order_id, first, 1), events=[order_event(order_id)])
    for sku in others:
        await conn.execute(PG_NEW_LINE, order_id, sku, 1)
    for sku in sorted(o.skus):
        await conn.execute(PG_TAKE_STOCK, sku)
    return order_id


# The floor: the event row written by the business statement itself (no statement,
# no round trip of its own); the key comes from the order id on the server.
ORDER_WITH_EVENT = """
WITH o AS (INSERT INTO bench_orders (customer, total_cents) VALUES (%s, %s) RETURNING id),
     e AS (INSERT INTO outbox (event_id, topic, key, event_type, payload)
           SELECT %s, %s, o.id::text, %s, %s FROM o)
SELECT id FROM o
"""


def psycopg_business_with_event(conn: psycopg.Connection[Any], o: Order) -> int:
    e = Event(topic="orders", event_type="order.placed", payload=PAYLOAD)
    row = conn.execute(
        ORDER_WITH_EVENT, (o.customer, o.total, e.event_id, e.topic, e.event_type, e.payload)
    ).fetchone()
    assert row is not None
    order_id = int(row[0])
    for sku in o.skus:
        conn.execute(NEW_LINE, (order_id, sku, 1))
    for sku in sorted(o.skus):
        conn.execute(TAKE_STOCK, (sku,))
    return order_id


async def psycopg_async_business(conn: psycopg.AsyncConnection[Any], o: Order) -> int:
    cur = await conn.execute(NEW_ORDER, (o.customer, o.total))
    row = await cur.fetchone()
    assert row is not None
    order_id = int(row[0])
    for sku in o.skus:
        await conn.execute(NEW_LINE, (order_id, sku, 1))
    for sku in sorted(o.skus):
        await conn.execute(TAKE_STOCK, (sku,))
    return order_id


async def asyncpg_business(conn: asyncpg.Connection, o: Order) -> int:
    order_id = int(await conn.fetchval(PG_NEW_ORDER, o.customer, o.total))
    for sku in o.skus:
        await conn.execute(PG_NEW_LINE, order_id, sku, 1)
    for sku in sorted(o.skus):
        await conn.execute(PG_TAKE_STOCK, sku)
    return order_id


def sqlalchemy_business(session: Session, o: Order) -> int:
    order_id = int(session.execute(SA_NEW_ORDER, {"c": o.customer, "t": o.total}).scalar_one())
    for sku in o.skus:
        session.execute(SA_NEW_LINE, {"o": order_id, "s": sku, "q": 1})
    for sku in sorted(o.skus):
        session.execute(SA_TAKE_STOCK, {"s": sku})
    return order_id


async def sqlalchemy_async_business(session: AsyncSession, o: Order) -> int:
    result = await session.execute(SA_NEW_ORDER, {"c": o.customer, "t": o.total})
    order_id = int(result.scalar_one())
    for sku in o.skus:
        await session.execute(SA_NEW_LINE, {"o": order_id, "s": sku, "q": 1})
    for sku in sorted(o.skus):
        await session.execute(SA_TAKE_STOCK, {"s": sku})
    return order_id


# The reference transaction written through the ORM: the order added and flushed (its id,
# one INSERT ... RETURNING), its 3 lines added (the ORM batches them into one INSERT at the
# commit's flush), the 3 stock rows taken by ORM UPDATE statements, COMMIT.


class _Base(DeclarativeBase):
    pass


class BenchOrder(_Base):
    __tablename__ = "bench_orders"
    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    customer: Mapped[str]
    total_cents: Mapped[int]


class BenchLine(_Base):
    __tablename__ = "bench_order_lines"
    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    order_id: Mapped[int] = mapped_column(sa.BigInteger)
    sku: Mapped[int]
    qty: Mapped[int]


class BenchStock(_Base):
    __tablename__ = "bench_stock"
    sku: Mapped[int] = mapped_column(primary_key=True)
    qty: Mapped[int]


def _take_stock(sku: int) -> Any:
    return sa.update(BenchStock).where(BenchStock.sku == sku).values(qty=BenchStock.qty - 1)


def orm_business(session: Session, o: Order) -> int:
    order = BenchOrder(customer=o.customer, total_cents=o.total)
    session.add(order)
    session.flush()
    session.add_all([BenchLine(order_id=order.id, sku=sku, qty=1) for sku in o.skus])
    for sku in sorted(o.skus):
        session.execute(_take_stock(sku))
    return order.id


async def orm_async_business(session: AsyncSession, o: Order) -> int:
    order = BenchOrder(customer=o.customer, total_cents=o.total)
    session.add(order)
    await session.flush()
    session.add_all([BenchLine(order_id=order.id, sku=sku, qty=1) for sku in o.skus])
    for sku in sorted(o.skus):
        await session.execute(_take_stock(sku))
    return order.id


# -- paths: each builds its variants (name -> one timed transaction) ------------------


class WritePath:
    """One write path: its connection and its variants, all sharing ``self.order``."""

    name = ""
    is_async = False

    def __init__(self, dsn: str, rng: random.Random) -> None:
        self.dsn = dsn
        self.rng = rng
        self.order = Order(rng)
        self.variants: dict[str, Any] = {}

    def next_order(self) -> None:
        self.order = Order(self.rng)


class PsycopgSync(WritePath):
    name = "psycopg (sync)"

    def __init__(self, dsn: str, rng: random.Random) -> None:
        super().__init__(dsn, rng)
        conn = psycopg.connect(dsn, autocommit=True)
        self.conn = conn
        stmts = Statements("outbox")

        def plain() -> None:
            with conn.transaction():
                psycopg_business(conn, self.order)

        def outbox(ob: Outbox) -> SyncTx:
            def run() -> None:
                with conn.transaction():
                    ob.put(conn, order_event(psycopg_business(conn, self.order)))

            return run

        def before() -> None:
            # The write as it was before the cursor reuse: a new cursor per call.
            with conn.transaction():
                e = order_event(psycopg_business(conn, self.order))
                conn.execute(stmts.insert_one, _params(e))

        def pipelined() -> None:
            # The technique the issue suggests: the INSERT rides in COMMIT's round trip
            # (psycopg pipeline mode). Kept as a measured reference, not a library API.
            tx = conn.transaction()
            tx.__enter__()
            try:
                e = order_event(psycopg_business(conn, self.order))
            except BaseException as exc:
                tx.__exit__(type(exc), exc, exc.__traceback__)
                raise
            with conn.pipeline():
                conn.execute(stmts.insert_one, _params(e))
                tx.__exit__(None, None, None)

        def same_statement() -> None:
            with conn.transaction():
                psycopg_business_with_event(conn, self.order)

        def with_commit(ob: Outbox) -> SyncTx:
            def run() -> None:
                with ob.transaction(conn) as tx:
                    tx.put(order_event(psycopg_business(conn, self.order)))

            return run

        emit = b"SELECT pg_logical_emit_message(true, 'outboxkit', $1::bytea)"
        emit_prepared = [False]

        def wal_message() -> None:
            # What a WAL-only outbox would cost (docs/architecture.md, "Not built yet: the
            # WAL relay"): the event as a transactional logical-decoding message, prepared,
            # in the COMMIT's round trip, the way Outbox.transaction() sends its INSERT.
            # No table, no index.
            pg = conn.pgconn
            conn.execute("BEGIN")  # as conn.transaction() does on an autocommit connection
            e = order_event(psycopg_business(conn, self.order))
            content = orjson.dumps({"id": str(e.event_id), "topic": e.topic}) + e.payload
            sends: list[Callable[[], object]] = []
            if not emit_prepared[0]:
                sends.append(lambda: pg.send_prepare(b"bench_emit", emit, [17]))
                emit_prepared[0] = True
            sends.append(lambda: pg.send_query_prepared(b"bench_emit", [content], [1]))
            sends.append(lambda: pg.send_query_params(b"COMMIT", None))
            _statuses, error = conn.wait(commit_pipeline(pg, sends))
            if error is not None:
                raise error

        def attached(ob: Outbox) -> SyncTx:
            def run() -> None:
                with conn.transaction():
                    psycopg_business_attached(conn, self.order, ob)

            return run

        self.variants = {
            "plain (A)": plain,
            "plain (A/A control)": plain,
            "outbox.put, notify off": outbox(Outbox(notify=False)),
            "outbox.put, notify on": outbox(Outbox()),
            "outbox.transaction, notify off": with_commit(Outbox(notify=False)),
            "outbox.transaction, notify on": with_commit(Outbox()),
            "outbox.execute_with, notify off": attached(Outbox(notify=False)),
            "outbox.execute_with, notify on": attached(Outbox()),
            # Outbox(ordered=True): the key's advisory lock in the same statement / pipeline
            "outbox.put, ordered": outbox(Outbox(ordered=True)),
            "outbox.transaction, ordered": with_commit(Outbox(ordered=True)),
            # Outbox(storage="wal"): a logical message per event instead of a row (notify off)
            "outbox.put, storage=wal": outbox(Outbox(storage="wal")),
            "outbox.transaction, storage=wal": with_commit(Outbox(storage="wal")),
            "outbox.execute_with, storage=wal": attached(Outbox(storage="wal")),
            "ref: conn.execute per put (before)": before,
            "ref: psycopg pipeline() for INSERT + COMMIT": pipelined,
            "ref: event in the order's statement": same_statement,
            "ref: WAL-only message with COMMIT (not a table row)": wal_message,
        }

    def close(self) -> None:
        self.conn.close()


class PsycopgPipeline(WritePath):
    name = "psycopg (sync), pipeline mode"

    def __init__(self, dsn: str, rng: random.Random) -> None:
        super().__init__(dsn, rng)
        conn = psycopg.connect(dsn, autocommit=True)
        self.conn = conn

        # The application runs its transaction in pipeline mode: statements whose
        # results it does not need are queued and sent with the next round trip, and
        # the outbox INSERT queues with them (reading the order id forces one sync).
        def plain() -> None:
            with conn.pipeline(), conn.transaction():
                psycopg_business(conn, self.order)

        def outbox(ob: Outbox) -> SyncTx:
            def run() -> None:
                with conn.pipeline(), conn.transaction():
                    ob.put(conn, order_event(psycopg_business(conn, self.order)))

            return run

        self.variants = {
            "plain (A)": plain,
            "plain (A/A control)": plain,
            "outbox.put, notify off": outbox(Outbox(notify=False)),
            "outbox.put, notify on": outbox(Outbox()),
        }

    def close(self) -> None:
        self.conn.close()


class SqlAlchemySync(WritePath):
    """The transaction on a sync Session through psycopg; ``business`` writes it as text
    statements or through the ORM (the subclass)."""

    name = "SQLAlchemy Session (psycopg)"
    business: Callable[[Session, Order], int] = staticmethod(sqlalchemy_business)

    def __init__(self, dsn: str, rng: random.Random) -> None:
        super().__init__(dsn, rng)
        self.engine = sa.create_engine(
            dsn.replace("postgresql://", "postgresql+psycopg://", 1), pool_size=1
        )
        engine, business = self.engine, self.business

        def plain() -> None:
            with Session(engine) as session, session.begin():
                business(session, self.order)

        def outbox(ob: Outbox) -> SyncTx:
            def run() -> None:
                with Session(engine) as session, session.begin():
                    ob.put(session, order_event(business(session, self.order)))

            return run

        def deferred(ob: Outbox) -> SyncTx:
            def run() -> None:
                with Session(engine) as session, session.begin():
                    ob.defer(session, order_event(business(session, self.order)))

            return run

        self.variants = {
            "plain (A)": plain,
            "plain (A/A control)": plain,
            "outbox.put, notify off": outbox(Outbox(notify=False)),
            "outbox.put, notify on": outbox(Outbox()),
            "outbox.defer, notify off": deferred(Outbox(notify=False)),
            "outbox.defer, notify on": deferred(Outbox()),
        }

    def close(self) -> None:
        self.engine.dispose()


class SqlAlchemyOrm(SqlAlchemySync):
    name = "SQLAlchemy ORM Session (psycopg)"
    business = staticmethod(orm_business)


class PsycopgAsync(WritePath):
    name = "psycopg (async)"
    is_async = True

    async def open(self) -> None:
        conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        self.conn = conn

        async def plain() -> None:
            async with conn.transaction():
                await psycopg_async_business(conn, self.order)

        def outbox(ob: Outbox) -> AsyncTx:
            async def run() -> None:
                async with conn.transaction():
                    order_id = await psycopg_async_business(conn, self.order)
                    await ob.aput(conn, order_event(order_id))

            return run

        def attached(ob: Outbox) -> AsyncTx:
            async def run() -> None:
                async with conn.transaction():
                    await psycopg_async_business_attached(conn, self.order, ob)

            return run

        def with_commit(ob: Outbox) -> AsyncTx:
            async def run() -> None:
                async with ob.atransaction(conn) as tx:
                    tx.put(order_event(await psycopg_async_business(conn, self.order)))

            return run

        self.variants = {
            "plain (A)": plain,
            "plain (A/A control)": plain,
            "outbox.aput, notify off": outbox(Outbox(notify=False)),
            "outbox.aput, notify on": outbox(Outbox()),
            "outbox.atransaction, notify off": with_commit(Outbox(notify=False)),
            "outbox.atransaction, notify on": with_commit(Outbox()),
            "outbox.aexecute_with, notify off": attached(Outbox(notify=False)),
            "outbox.aexecute_with, notify on": attached(Outbox()),
        }

    async def aclose(self) -> None:
        await self.conn.close()


class Asyncpg(WritePath):
    name = "asyncpg"
    is_async = True

    async def open(self) -> None:
        conn = await asyncpg.connect(self.dsn)
        self.conn = conn

        async def plain() -> None:
            async with conn.transaction():
                await asyncpg_business(conn, self.order)

        def outbox(ob: Outbox) -> AsyncTx:
            async def run() -> None:
                async with conn.transaction():
                    await ob.aput(conn, order_event(await asyncpg_business(conn, self.order)))

            return run

        def attached(ob: Outbox) -> AsyncTx:
            async def run() -> None:
                async with conn.transaction():
                    await asyncpg_business_attached(conn, self.order, ob)

            return run

        async def simple_query_commit() -> None:
            # What asyncpg could do at best for a deferred write (not a library API): the
            # INSERT, its values as literals, and the COMMIT as one simple-protocol query,
            # one round trip. Under SQLAlchemy it would mean rewriting asyncpg's and
            # SQLAlchemy's private transaction state (their COMMIT is their own query).
            await conn.execute("BEGIN")
            e = order_event(await asyncpg_business(conn, self.order))
            await conn.execute(
                "INSERT INTO outbox (event_id, topic, key, event_type, payload)"
                f" VALUES ('{e.event_id}', {_literal(e.topic)}, {_literal(e.key or '')},"
                f" {_literal(e.event_type)}, '\\x{e.payload.hex()}'::bytea); COMMIT"
            )

        self.variants = {
            "plain (A)": plain,
            "plain (A/A control)": plain,
            "outbox.aput, notify off": outbox(Outbox(notify=False)),
            "outbox.aput, notify on": outbox(Outbox()),
            "outbox.aexecute_with, notify off": attached(Outbox(notify=False)),
            "outbox.aexecute_with, notify on": attached(Outbox()),
            "ref: INSERT + COMMIT as one simple query": simple_query_commit,
        }

    async def aclose(self) -> None:
        await self.conn.close()


class SqlAlchemyAsync(WritePath):
    """The transaction on an AsyncSession; ``driver`` picks the DBAPI driver, ``business``
    writes it as text statements or through the ORM (the subclasses)."""

    name = "SQLAlchemy AsyncSession (asyncpg)"
    driver = "asyncpg"
    business: Callable[[AsyncSession, Order], Awaitable[int]] = staticmethod(
        sqlalchemy_async_business
    )
    is_async = True

    async def open(self) -> None:
        self.engine = create_async_engine(
            self.dsn.replace("postgresql://", f"postgresql+{self.driver}://", 1), pool_size=1
        )
        engine, business = self.engine, self.business

        async def plain() -> None:
            async with AsyncSession(engine) as session, session.begin():
                await business(session, self.order)

        def outbox(ob: Outbox) -> AsyncTx:
            async def run() -> None:
                async with AsyncSession(engine) as session, session.begin():
                    order_id = await business(session, self.order)
                    await ob.aput(session, order_event(order_id))

            return run

        def deferred(ob: Outbox) -> AsyncTx:
            async def run() -> None:
                async with AsyncSession(engine) as session, session.begin():
                    order_id = await business(session, self.order)
                    await ob.adefer(session, order_event(order_id))

            return run

        self.variants = {
            "plain (A)": plain,
            "plain (A/A control)": plain,
            "outbox.aput, notify off": outbox(Outbox(notify=False)),
            "outbox.aput, notify on": outbox(Outbox()),
            "outbox.adefer, notify off": deferred(Outbox(notify=False)),
            "outbox.adefer, notify on": deferred(Outbox()),
        }

    async def aclose(self) -> None:
        await self.engine.dispose()


class SqlAlchemyOrmAsync(SqlAlchemyAsync):
    name = "SQLAlchemy ORM AsyncSession (asyncpg)"
    business = staticmethod(orm_async_business)


class SqlAlchemyOrmAsyncPsycopg(SqlAlchemyOrmAsync):
    name = "SQLAlchemy ORM AsyncSession (psycopg)"
    driver = "psycopg"


def _literal(text: str) -> str:
    """A SQL string literal (standard_conforming_strings on; the bench's own values)."""
    return "'" + text.replace("'", "''") + "'"


def _params(e: Event) -> tuple[Any, ...]:
    headers = orjson.dumps(e.headers).decode() if e.headers else "{}"
    return (
        e.event_id,
        e.topic,
        e.key,
        e.event_type,
        e.aggregate_type,
        e.aggregate_id,
        e.payload,
        headers,
        e.occurred_at,
        e.schema_version,
        e.available_at,
    )


# -- timing -------------------------------------------------------------------------


def run_sync_block(path: WritePath, rounds: int, timings: Timings) -> None:
    items = list(path.variants.items())
    for _ in range(rounds):
        path.rng.shuffle(items)
        for name, tx in items:
            path.next_order()
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            tx()
            t1 = time.perf_counter_ns()
            timings.wall[name].append((t1 - t0) / 1e6)
            timings.cpu[name].append((time.thread_time_ns() - c0) / 1e6)


async def run_async_block(path: WritePath, rounds: int, timings: Timings) -> None:
    items = list(path.variants.items())
    for _ in range(rounds):
        path.rng.shuffle(items)
        for name, tx in items:
            path.next_order()
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            await tx()
            t1 = time.perf_counter_ns()
            timings.wall[name].append((t1 - t0) / 1e6)
            timings.cpu[name].append((time.thread_time_ns() - c0) / 1e6)


class Timings:
    """Per variant: wall-clock latency and this process's CPU time, in ms, one per round."""

    def __init__(self, variants: dict[str, Any]) -> None:
        self.wall: dict[str, list[float]] = {v: [] for v in variants}
        self.cpu: dict[str, list[float]] = {v: [] for v in variants}


def run_interleaved(
    paths: list[WritePath], rounds: int, rng: random.Random, loop: asyncio.AbstractEventLoop
) -> tuple[dict[str, Timings], float]:
    """Warm every path up, then time ``rounds`` rounds, paths taking turns in blocks.

    Returns the timings per path and the seconds taken (bench/tasks_enqueue.py uses it too).
    """

    def block(path: WritePath, n: int, timings: Timings) -> None:
        if path.is_async:
            loop.run_until_complete(run_async_block(path, n, timings))
        else:
            run_sync_block(path, n, timings)

    timings = {p.name: Timings(p.variants) for p in paths}
    started = time.time()
    for path in paths:  # warm-up, discarded
        block(path, WARMUP_ROUNDS, Timings(path.variants))
    done = 0
    while done < rounds:
        n = min(BLOCK_ROUNDS, rounds - done)
        rng.shuffle(paths)
        for path in paths:
            block(path, n, timings[path.name])
        done += n
        print(f"  {done}/{rounds} rounds, {time.time() - started:.0f} s", flush=True)
    return timings, time.time() - started


def close_paths(paths: list[WritePath], loop: asyncio.AbstractEventLoop) -> None:
    for path in paths:
        if path.is_async:
            loop.run_until_complete(path.aclose())  # type: ignore[attr-defined]
        else:
            path.close()  # type: ignore[attr-defined]
    loop.close()


def wal_bytes_per_tx(path: WritePath, n: int = 300) -> dict[str, float]:
    """WAL bytes each variant writes per transaction (one variant at a time, untimed)."""
    out = {}
    with psycopg.connect(path.dsn, autocommit=True) as probe:

        def lsn() -> Any:
            row = probe.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
            assert row is not None
            return row[0]

        for name, tx in path.variants.items():
            if name == "plain (A/A control)":
                continue
            start = lsn()
            for _ in range(n):
                path.next_order()
                tx()
            row = probe.execute("SELECT pg_wal_lsn_diff(%s, %s)", (lsn(), start)).fetchone()
            assert row is not None
            out[name] = round(float(row[0]) / n, 1)
    return out


def ratio_ci(
    xs: list[float], base: list[float], rng: random.Random, resamples: int
) -> tuple[float, float]:
    """95 % bootstrap interval of median(xs)/median(base), resampling whole rounds.

    Round i of every variant ran back to back, so resampling rounds keeps each
    variant paired with the baseline of the same moment (the noise they shared).
    """
    n = min(len(xs), len(base))
    indices = range(n)
    ratios = []
    for _ in range(resamples):
        pick = rng.choices(indices, k=n)
        ratios.append(
            statistics.median([xs[i] for i in pick]) / statistics.median([base[i] for i in pick])
        )
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def summarise(
    path: WritePath, timings: Timings, rng: random.Random, resamples: int
) -> list[dict[str, Any]]:
    base = timings.wall["plain (A)"]
    base_med = statistics.median(base)
    base_cpu = statistics.median(timings.cpu["plain (A)"])
    out = []
    for name, xs in timings.wall.items():
        cpu = statistics.median(timings.cpu[name])
        med = statistics.median(xs)
        lo, hi = (1.0, 1.0) if xs is base else ratio_ci(xs, base, rng, resamples)
        overhead = (med / base_med - 1) * 100
        row: dict[str, Any] = {
            "path": path.name,
            "variant": name,
            "rounds": len(xs),
            "median_ms": round(med, 4),
            "p99_ms": round(sorted(xs)[int(len(xs) * 0.99) - 1], 4),
            "overhead_pct": round(overhead, 2),
            "ci95_pct": [round((lo - 1) * 100, 2), round((hi - 1) * 100, 2)],
            "client_cpu_ms": round(cpu, 4),
            "client_cpu_extra_us": round((cpu - base_cpu) * 1000, 1),
        }
        if name.startswith(("outbox", "ref:")):
            row["target_met"] = overhead <= TARGET_PCT
        out.append(row)
    return out


def _as_url(dsn: str) -> str:
    if dsn.startswith(("postgresql://", "postgres://")):
        return dsn
    from urllib.parse import quote

    parts = psycopg.conninfo.conninfo_to_dict(dsn)
    user = quote(str(parts.pop("user", "postgres")), safe="")
    password = parts.pop("password", None)
    auth = user + (":" + quote(str(password), safe="") if password else "")
    host = str(parts.pop("host", "127.0.0.1"))
    port = parts.pop("port", 5432)
    dbname = quote(str(parts.pop("dbname", "postgres")), safe="")
    query = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in parts.items())
    return f"postgresql://{auth}@{host}:{port}/{dbname}" + (f"?{query}" if query else "")


def server_facts(dsn: str) -> dict[str, Any]:
    names = (
        "server_version",
        "fsync",
        "synchronous_commit",
        "wal_sync_method",
        "full_page_writes",
        "wal_level",
        "shared_buffers",
        "max_wal_size",
        "checkpoint_timeout",
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, setting, unit FROM pg_settings WHERE name = ANY(%s)", (list(names),)
        ).fetchall()
    return {
        name: f"{setting}{'' if unit is None else ' x ' + unit}" for name, setting, unit in rows
    }


def machine_facts() -> dict[str, Any]:
    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "ram_gib": round(mem_kb / 1024 / 1024, 1),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dsn", required=True)
    ap.add_argument(
        "--rounds",
        type=int,
        default=int(os.environ.get("OUTBOXKIT_BENCH_WRITE_ROUNDS", "3000")),
        help="rounds per path (env OUTBOXKIT_BENCH_WRITE_ROUNDS; default 3000: 3-4 min)",
    )
    ap.add_argument(
        "--paths",
        default="all",
        help="comma-separated subset of: psycopg, psycopg-pipeline, psycopg-async, asyncpg,"
        " sqlalchemy, sqlalchemy-async, sqlalchemy-orm, sqlalchemy-orm-async (psycopg),"
        " sqlalchemy-orm-asyncpg (default: all)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "write_overhead.json"))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 300 rounds, results to write_overhead.quick.json (figures kept)",
    )
    args = ap.parse_args()
    args.dsn = _as_url(args.dsn)  # asyncpg and SQLAlchemy take URLs, not key=value conninfo
    if args.quick:
        args.rounds = min(args.rounds, 300)
        args.out = args.out.replace(".json", ".quick.json")

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("DROP TABLE IF EXISTS outbox, outboxkit_schema_versions")
    migrate(args.dsn)

    all_paths: dict[str, type[WritePath]] = {
        "psycopg": PsycopgSync,
        "psycopg-pipeline": PsycopgPipeline,
        "psycopg-async": PsycopgAsync,
        "asyncpg": Asyncpg,
        "sqlalchemy": SqlAlchemySync,
        "sqlalchemy-async": SqlAlchemyAsync,
        "sqlalchemy-orm": SqlAlchemyOrm,
        "sqlalchemy-orm-async": SqlAlchemyOrmAsyncPsycopg,
        "sqlalchemy-orm-asyncpg": SqlAlchemyOrmAsync,
    }
    chosen = list(all_paths) if args.paths == "all" else args.paths.split(",")
    rng = random.Random(args.seed)
    loop = asyncio.new_event_loop()
    paths: list[WritePath] = []
    for key in chosen:
        path = all_paths[key](args.dsn, random.Random(rng.random()))
        if path.is_async:
            loop.run_until_complete(path.open())  # type: ignore[attr-defined]
        paths.append(path)

    timings, elapsed = run_interleaved(paths, args.rounds, rng, loop)
    loadavg_end = os.getloadavg()
    wal = {p.name: wal_bytes_per_tx(p) for p in paths if not p.is_async}
    close_paths(paths, loop)

    order = {k: i for i, k in enumerate(all_paths.values())}
    paths.sort(key=lambda p: order[type(p)])
    results: list[dict[str, Any]] = []
    for path in paths:
        results += summarise(path, timings[path.name], rng, BOOTSTRAP_RESAMPLES)
    for r in results:
        if r["path"] in wal and r["variant"] in wal[r["path"]]:
            r["wal_bytes_per_tx"] = wal[r["path"]][r["variant"]]

    print(
        f"\n{'path':<34} {'variant':<36} {'median ms':>9} {'overhead':>9} {'95% CI':>16}"
        f" {'client CPU':>10} {'WAL B/tx':>8}"
    )
    noisy = []
    for r in results:
        lo, hi = r["ci95_pct"]
        wal_b = r.get("wal_bytes_per_tx")
        print(
            f"{r['path']:<34} {r['variant']:<36} {r['median_ms']:>9.3f}"
            f" {r['overhead_pct']:>+8.1f}% [{lo:>+6.1f}, {hi:>+6.1f}]"
            f" {r['client_cpu_extra_us']:>+8.0f}us {'' if wal_b is None else f'{wal_b:8.0f}'}"
        )
        if r["variant"] == "plain (A/A control)" and abs(r["overhead_pct"]) > AA_TOLERANCE_PCT:
            noisy.append(r["path"])
    if noisy:
        print(
            f"\nA/A control beyond ±{AA_TOLERANCE_PCT} % for {', '.join(noisy)}:"
            " the machine was noisy; re-run (more rounds, or a quieter moment)."
        )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_facts()
    machine["loadavg_end"] = loadavg_end
    out.write_text(
        json.dumps(
            {
                "benchmark": "write_overhead",
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "rounds_per_path": args.rounds,
                "elapsed_s": round(elapsed, 1),
                "target_pct": TARGET_PCT,
                "aa_tolerance_pct": AA_TOLERANCE_PCT,
                "noisy_paths": noisy,
                "machine": machine,
                "server": server_facts(args.dsn),
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
