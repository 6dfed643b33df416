"""outboxkit behind PgBouncer in transaction pooling mode (Debian's 1.18 on these machines).

Transaction pooling hands each transaction whichever server connection is free: session
state (prepared statements before 1.21, session advisory locks, LISTEN) does not follow
the client. Every test here talks to PostgreSQL only through a real PgBouncer, and checks
what reached the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outboxkit import Event, Outbox, Relay
from outboxkit.backends.postgres._connection import split_pooler
from outboxkit.backends.postgres.migrate import migrate, migrate_inbox
from outboxkit.consumers.base import ReceivedEvent
from outboxkit.errors import ConfigurationError
from outboxkit.ops.cli import main
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.publishers.nats import NatsPublisher
from tests.support.pgbouncer import PgBouncer
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events
from tests.support.servers import consume_nats, ensure_stream, unique_name


def _event(topic: str = "orders", n: int = 0) -> Event:
    return Event(topic=topic, event_type="order.placed", payload={"n": n}, key=f"k{n % 3}")


@contextlib.contextmanager
def _two(dsn: str, **options: Any) -> Iterator[tuple[psycopg.Connection[Any], ...]]:
    with psycopg.connect(dsn, **options) as a, psycopg.connect(dsn, **options) as b:
        yield a, b


@pytest.fixture
def pooled_dsn(db_dsn: str, pgbouncer: PgBouncer) -> str:
    """The test's database through the transaction pooler."""
    return pgbouncer.dsn_for(psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"])


async def _stream(nats_server: Any) -> tuple[str, str]:
    root = unique_name("pgb")
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    return root, root.upper()


async def test_the_relay_behind_pgbouncer_publishes_the_whole_backlog(
    db_dsn: str, pooled_dsn: str, nats_server: Any
) -> None:
    """PgBouncer 1.18 keeps no prepared statement across transactions: psycopg's automatic
    ones (prepare_threshold=5) broke every claim after the first few batches."""
    root, stream = await _stream(nats_server)
    events = make_events(f"{root}.orders", 300)
    for i in range(0, 300, 30):  # several claims, each statement run more than 5 times
        write_events(pooled_dsn, events[i : i + 30])
    async with running_relay(
        pooled_dsn, NatsPublisher.from_url(nats_server.url), batch_size=10, max_in_flight=2
    ):
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the backlog to drain")
    msgs = await consume_nats(nats_server.url, stream, f"{root}.>", None)
    ids = {m.headers["Nats-Msg-Id"] for m in msgs}
    assert ids == {str(e.event_id) for e in events}


def _advisory_locks(dsn: str) -> list[tuple[str, str]]:
    """(application_name, client port or '') of every session holding an advisory lock in
    the test's database (a pooled server connection shows PgBouncer's address)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT a.application_name, coalesce(a.client_port::text, '') FROM pg_locks l"
            " JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory'"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
    return [(str(r[0]), str(r[1])) for r in rows]


async def test_a_relay_behind_pgbouncer_takes_no_session_lock_and_polls(
    db_dsn: str, pooled_dsn: str, nats_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The wake-up gate's lock is a session's: taken through the pooler it stayed on a
    server connection other clients then used (writers notifying for nobody). Without a
    direct DSN the relay takes none, says so, and its poll finds every event."""
    root, stream = await _stream(nats_server)
    publisher = NatsPublisher.from_url(nats_server.url)
    async with running_relay(pooled_dsn, publisher, poll_interval=0.3):
        await asyncio.sleep(1.0)  # idle: an unpooled relay would hold the gate now
        assert _advisory_locks(db_dsn) == []
        write_events(pooled_dsn, [_event(f"{root}.orders")])
        await wait_for(lambda: count(db_dsn) == 0, timeout=10, what="the poll to find it")
        assert _advisory_locks(db_dsn) == []
    assert "goes through a transaction pooler" in caplog.text
    assert len(await consume_nats(nats_server.url, stream, f"{root}.>", None)) == 1


async def test_a_direct_dsn_brings_back_the_wake_ups(
    db_dsn: str, pooled_dsn: str, nats_server: Any
) -> None:
    """LISTEN and the gate's lock on PostgreSQL itself, claims and settles through the
    pooler: an event is published long before the 10 s poll would find it."""
    root, _ = await _stream(nats_server)
    publisher = NatsPublisher.from_url(nats_server.url)
    async with running_relay(pooled_dsn, publisher, poll_interval=10.0, direct_dsn=db_dsn):
        await wait_for(
            lambda: (
                ("outboxkit-relay:gate", "") not in _advisory_locks(db_dsn)
                and any(a == "outboxkit-relay:gate" for a, _ in _advisory_locks(db_dsn))
            ),
            timeout=10,
            what="the relay to wait with the gate closed",
        )
        started = time.monotonic()
        write_events(pooled_dsn, [_event(f"{root}.orders")], outbox=Outbox(notify=True))
        await wait_for(lambda: count(db_dsn) == 0, timeout=5, what="the wake-up")
        assert time.monotonic() - started < 3.0


async def test_a_direct_dsn_through_the_pooler_too_is_refused(
    pooled_dsn: str, nats_server: Any
) -> None:
    relay = Relay(pooled_dsn, NatsPublisher.from_url(nats_server.url), direct_dsn=pooled_dsn)
    with pytest.raises(ConfigurationError, match="--direct-dsn goes through a transaction pooler"):
        await asyncio.wait_for(relay.run(), 20)


async def test_the_wal_relay_behind_pgbouncer_is_refused_with_what_to_do(
    pooled_dsn: str, nats_server: Any
) -> None:
    relay = Relay(pooled_dsn, NatsPublisher.from_url(nats_server.url), source="cdc")
    with pytest.raises(ConfigurationError, match="point its --dsn at PostgreSQL itself"):
        await asyncio.wait_for(relay.run(), 20)


@pytest.mark.exclusive  # the hand-over must happen while writes remain: alone under xdist
async def test_two_ordered_relays_behind_pgbouncer_hand_partitions_over_and_keep_key_order(
    db_dsn: str, pooled_dsn: str, nats_server: Any
) -> None:
    """Partition leases are single statements: a second ordered relay joins mid-stream
    through the pooler (a generated id needs no session lock; the explicit one takes it on
    the direct DSN) and takes half. From the broker: each partition's messages come from
    relay A, then only from B (never both at once), and every key is in order."""
    migrate(db_dsn, ordered=True, partitions=8)
    root, stream = await _stream(nats_server)
    ordered = Outbox(ordered=True)
    events = [
        Event(topic=f"{root}.orders", event_type="t", payload={"n": n}, key=f"key-{n % 20}")
        for n in range(400)
    ]
    chunks = [events[i : i + 40] for i in range(0, len(events), 40)]
    options: dict[str, Any] = {"ordered": True, "lease": 3.0, "retention": "keep"}
    a = _Tagging(NatsPublisher.from_url(nats_server.url), "a")
    b = _Tagging(NatsPublisher.from_url(nats_server.url), "b")

    async def write(part: list[list[Event]]) -> None:
        for chunk in part:
            await asyncio.to_thread(write_events, pooled_dsn, chunk, outbox=ordered)
            await asyncio.sleep(0.1)

    async with running_relay(pooled_dsn, a, **options):
        await wait_for(lambda: _owners(db_dsn) == 1, timeout=15, what="A to own the partitions")
        await write(chunks[:4])
        async with running_relay(pooled_dsn, b, relay_id="b", direct_dsn=db_dsn, **options):
            writing = asyncio.create_task(write(chunks[4:]))
            await wait_for(lambda: _owners(db_dsn) == 2, timeout=15, what="the split")
            await writing
            await wait_for(
                lambda: count(db_dsn, "status <> 1") == 0, timeout=30, what="all published"
            )
    got = await consume_nats(nats_server.url, stream, f"{root}.>", None)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        partition = {
            str(eid): int(p) for eid, p in conn.execute("SELECT event_id, partition FROM outbox")
        }
    by_partition: dict[int, list[str]] = {}
    per_key: dict[str, list[str]] = {}
    seen: set[str] = set()
    for msg in got:
        eid = msg.headers["Nats-Msg-Id"]
        by_partition.setdefault(partition[eid], []).append(msg.headers["x-relay"])
        if eid not in seen:
            seen.add(eid)
            per_key.setdefault(msg.headers["ce-partitionkey"], []).append(eid)
    expected: dict[str, list[str]] = {}
    for e in events:
        expected.setdefault(str(e.key), []).append(str(e.event_id))
    assert per_key == expected
    changes = {p: sum(x != y for x, y in itertools.pairwise(r)) for p, r in by_partition.items()}
    assert all(n <= 1 for n in changes.values()), changes  # A...A B...B, never A B A
    assert "b" in {r for relays in by_partition.values() for r in relays}


class _Tagging:
    """A publisher that adds its relay's name as a header (x-relay), then publishes."""

    def __init__(self, inner: NatsPublisher, relay: str) -> None:
        self.inner = inner
        self.relay = relay
        self.name = inner.name
        self.batch_shape = (50, 4)

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        tagged = [
            dataclasses.replace(m, headers={**m.headers, "x-relay": self.relay}) for m in messages
        ]
        return await self.inner.publish_batch(tagged)


def _owners(dsn: str) -> int:
    """How many relays hold ordered partitions now."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT owner) FROM outbox_partitions WHERE expires_at > now()"
        ).fetchone()
    return int(row[0]) if row else 0


async def test_an_explicit_relay_id_behind_pgbouncer_needs_a_direct_dsn(
    db_dsn: str, pooled_dsn: str, nats_server: Any
) -> None:
    """Its guard is a session advisory lock: refused rather than taken on a pooled
    server connection (where it would stay, and the next check would fail or pass by luck)."""
    migrate(db_dsn, ordered=True, partitions=4)
    relay = Relay(
        pooled_dsn, NatsPublisher.from_url(nats_server.url), ordered=True, relay_id="fixed"
    )
    with pytest.raises(ConfigurationError, match="--direct-dsn"):
        await asyncio.wait_for(relay.run(), 20)
    assert _advisory_locks(db_dsn) == []


async def test_a_consumer_runner_and_its_inbox_behind_pgbouncer_apply_each_event_once(
    db_dsn: str, pooled_dsn: str, nats_server: Any
) -> None:
    import nats

    from outboxkit.consumers.nats import NatsConsumer

    migrate_inbox(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (event_id uuid, n int)")
    root, stream = await _stream(nats_server)

    async def handler(tx: psycopg.AsyncConnection[Any], event: ReceivedEvent) -> None:
        n = event.json()["n"]
        await tx.execute("INSERT INTO ledger VALUES (%s, %s)", (event.event_id, n))

    events = [_event(f"{root}.orders", n) for n in range(30)]
    write_events(pooled_dsn, events)
    runner = NatsConsumer(
        pooled_dsn,
        handler,
        consumer="billing",
        servers=nats_server.url,
        stream=stream,
        subject=f"{root}.orders",
        fetch_timeout=0.2,
    )
    task = asyncio.create_task(runner.run())
    try:
        async with running_relay(pooled_dsn, NatsPublisher([nats_server.url], stream=stream)):
            await wait_for(lambda: count(db_dsn) == 0, what="the relay to publish")

        def applied(n: int, duplicates: int) -> Callable[[], bool]:
            def check() -> bool:
                if task.done():
                    task.result()  # a crashed runner, at once
                return count(db_dsn, table="ledger") == n and runner.stats.duplicates >= duplicates

            return check

        await wait_for(applied(30, 0), timeout=30, what="the runner to apply every event")
        # JetStream drops a re-publish with the same Nats-Msg-Id: a duplicate past it
        first = (await consume_nats(nats_server.url, stream, f"{root}.>", 1))[0]
        nc = await nats.connect(nats_server.url)
        try:
            headers = {k: v for k, v in first.headers.items() if k != "Nats-Msg-Id"}
            await nc.jetstream().publish(first.subject, first.data, headers=headers)
        finally:
            await nc.close()
        await wait_for(applied(30, 1), timeout=30, what="the inbox to skip the duplicate")
    finally:
        runner.stop()
        await asyncio.wait_for(task, 30)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        ns = [r[0] for r in conn.execute("SELECT n FROM ledger ORDER BY n").fetchall()]
    assert ns == list(range(30))
    assert count(db_dsn, table="processed_events") == 30


# -- the write side ---------------------------------------------------------------------
# Two clients whose transactions overlap, the outer one alternating: PgBouncer hands each
# transaction the server connection released last, so each client's transactions run on
# one server connection, then the other.


def test_transaction_writes_through_pgbouncer_on_default_psycopg_connections(
    db_dsn: str, pooled_dsn: str
) -> None:
    """transaction() prepared its INSERT at the first commit of a connection; behind
    PgBouncer 1.18 the next commit on another server connection failed with `prepared
    statement "outboxkit_put_..." does not exist`. It now finds the pooler and prepares none."""
    outbox = Outbox()
    with _two(pooled_dsn) as (a, b):
        for i in range(8):
            outer, inner = (a, b) if i % 2 else (b, a)
            with outbox.transaction(outer) as t1:
                outer.execute("SELECT 1")  # holds a server connection
                t1.put(_event(n=i))
                with outbox.transaction(inner) as t2:
                    inner.execute("SELECT 1")
                    t2.put_many([_event(n=i), _event(n=i + 1)])
    assert count(db_dsn) == 24


async def test_atransaction_writes_through_pgbouncer(db_dsn: str, pooled_dsn: str) -> None:
    outbox = Outbox()
    async with (
        await psycopg.AsyncConnection.connect(pooled_dsn) as a,
        await psycopg.AsyncConnection.connect(pooled_dsn) as b,
    ):
        for i in range(8):
            outer, inner = (a, b) if i % 2 else (b, a)
            async with outbox.atransaction(outer) as t1:
                await outer.execute("SELECT 1")
                t1.put(_event(n=i))
                async with outbox.atransaction(inner) as t2:
                    await inner.execute("SELECT 1")
                    t2.put(_event(n=i))
    assert count(db_dsn) == 16


def test_put_and_put_many_write_through_pgbouncer(db_dsn: str, pooled_dsn: str) -> None:
    """psycopg behind PgBouncer < 1.21 needs prepare_threshold=None for every statement
    (psycopg's own advice): put() and put_many() then work as they do elsewhere."""
    outbox = Outbox()
    with _two(pooled_dsn, prepare_threshold=None) as (a, b):
        for i in range(8):
            outer, inner = (a, b) if i % 2 else (b, a)
            with outer.transaction():
                outer.execute("SELECT 1")
                outbox.put(outer, _event(n=i))
                with inner.transaction():
                    outbox.put_many(inner, [_event(n=i), _event(n=i + 1)])
    assert count(db_dsn) == 24


async def test_asyncpg_writes_through_pgbouncer(db_dsn: str, pooled_dsn: str) -> None:
    """asyncpg behind PgBouncer < 1.21: statement_cache_size=0 (asyncpg's own advice)."""
    dsn = pooled_dsn_url(pooled_dsn)
    outbox = Outbox()
    a = await asyncpg.connect(dsn, statement_cache_size=0)
    b = await asyncpg.connect(dsn, statement_cache_size=0)
    try:
        for i in range(8):
            outer, inner = (a, b) if i % 2 else (b, a)
            async with outer.transaction():
                await outer.execute("SELECT 1")
                await outbox.aput(outer, _event(n=i))
                async with inner.transaction():
                    await outbox.aput_many(inner, [_event(n=i), _event(n=i + 1)])
    finally:
        await a.close()
        await b.close()
    assert count(db_dsn) == 24


async def test_sqlalchemy_sessions_write_through_pgbouncer(db_dsn: str, pooled_dsn: str) -> None:
    url = pooled_dsn_url(pooled_dsn).replace("postgresql://", "postgresql+psycopg://")
    outbox = Outbox()
    engine = sa.create_engine(url, connect_args={"prepare_threshold": None})
    aengine = create_async_engine(url, connect_args={"prepare_threshold": None})
    try:
        for i in range(6):
            with Session(engine) as session, session.begin():
                session.execute(sa.text("SELECT 1"))
                outbox.put(session, _event(n=i))
                async with AsyncSession(aengine) as asession, asession.begin():
                    await outbox.aput_many(asession, [_event(n=i), _event(n=i + 1)])
    finally:
        engine.dispose()
        await aengine.dispose()
    assert count(db_dsn) == 18


def pooled_dsn_url(dsn: str) -> str:
    """The key=value DSN as a URL (asyncpg and SQLAlchemy take URLs)."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    return f"postgresql://{info['user']}@{info['host']}:{info['port']}/{info['dbname']}"


# -- the CLI ------------------------------------------------------------------------------


async def test_the_cli_relay_with_pooler_and_direct_dsn_publishes_on_wake_up(
    db_dsn: str, pooler_url: str, nats_server: Any
) -> None:
    """`outboxkit relay --pooler transaction --direct-dsn ...`: claims through the pooler,
    woken through PostgreSQL itself (an event long before the 10 s poll), exit 0 on SIGTERM."""
    root, stream = await _stream(nats_server)
    proc = _cli_relay(
        "--dsn",
        pooler_url,
        "--pooler",
        "transaction",
        "--direct-dsn",
        db_dsn,
        "--broker",
        nats_server.url,
        "--poll-interval",
        "10",
    )
    try:
        await wait_for(
            lambda: any(a == "outboxkit-relay:gate" for a, _ in _advisory_locks(db_dsn)),
            timeout=20,
            what="the relay to wait with its gate closed",
        )
        write_events(pooler_url, [_event(f"{root}.orders")], outbox=Outbox(notify=True))
        await wait_for(lambda: count(db_dsn) == 0, timeout=5, what="the wake-up")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert len(await consume_nats(nats_server.url, stream, f"{root}.>", None)) == 1


def test_the_cli_refuses_a_direct_dsn_through_the_pooler(pooler_url: str) -> None:
    result = CliRunner().invoke(
        main,
        [
            "relay",
            "--dsn",
            pooler_url,
            "--direct-dsn",
            pooler_url,
            "--broker",
            "nats://127.0.0.1:1",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "--direct-dsn goes through a transaction pooler too" in result.output


def _cli_relay(*args: str) -> subprocess.Popen[str]:
    """``outboxkit relay ARGS`` as a child process (its output: stdout, with stderr)."""
    return subprocess.Popen(
        [sys.executable, "-m", "outboxkit", "relay", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def pooler_url(pooled_dsn: str) -> str:
    return pooled_dsn_url(pooled_dsn)


@pytest.mark.parametrize(
    ("dsn", "bare", "mode"),
    [
        ("postgresql://u@h:6432/db?pooler=transaction", "postgresql://u@h:6432/db", "transaction"),
        (
            "postgresql://u@h/db?sslmode=disable&pooler=none",
            "postgresql://u@h/db?sslmode=disable",
            "none",
        ),
        ("host=h port=6432 pooler=session dbname=db", "host=h port=6432 dbname=db", "session"),
        ("host=h dbname=db", "host=h dbname=db", "auto"),
    ],
)
def test_the_pooler_option_is_taken_out_of_the_dsn(dsn: str, bare: str, mode: str) -> None:
    assert split_pooler(dsn) == (bare, mode)


def test_an_unknown_pooler_mode_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigurationError, match="use one of auto, none, session, transaction"):
        split_pooler("postgresql://u@h/db?pooler=pgcat")


def test_a_relay_with_an_unknown_pooler_mode_is_refused_at_construction() -> None:
    publisher = NatsPublisher.from_url("nats://127.0.0.1:1")
    with pytest.raises(ConfigurationError, match="pooler='pgcat' is not a pooler mode"):
        Relay("postgresql://u@h/db", publisher, pooler="pgcat")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="pooler='x' is not a pooler mode"):
        Relay("postgresql://u@h/db?pooler=x", publisher)


def test_migrate_and_the_admin_commands_work_through_pgbouncer(
    empty_db_dsn: str, pgbouncer: PgBouncer
) -> None:
    """migrate (its lock is transaction-scoped) and status, replay, again and again on
    pooled server connections (more than psycopg's 5 runs that would prepare a statement)."""
    name = psycopg.conninfo.conninfo_to_dict(empty_db_dsn)["dbname"]
    url = pgbouncer.url_for(str(name)) + "?pooler=transaction"
    migrate(url)
    write_events(empty_db_dsn, [_event(n=n) for n in range(3)])
    with psycopg.connect(empty_db_dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET status = 2, last_error = 'boom' WHERE id = 1")
    runner = CliRunner()
    for _ in range(6):
        out = runner.invoke(main, ["status", "--dsn", url, "--json"])
        assert out.exit_code == 0, out.output
        assert '"failed": 1' in out.output
    out = runner.invoke(main, ["replay", "--dsn", url, "--all-failed"])
    assert out.exit_code == 0, out.output
    assert count(empty_db_dsn, "status = 0") == 3
