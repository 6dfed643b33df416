"""`ReplicationStream` on a real PostgreSQL with wal_level=logical: what the slot delivers."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import psutil
import psycopg
import pytest

from outboxkit import Event, Outbox
from outboxkit.cdc import slots
from outboxkit.cdc.errors import ReplicationConnectionLost, SlotInUse, SlotNotFound
from outboxkit.cdc.stream import Begin, Commit, Item, Keepalive, Message, ReplicationStream, Row
from outboxkit.testing import EmbeddedPostgres, EmbeddedServerUnavailable, TcpProxy
from tests.support.cdc_relaying import slot_confirmed
from tests.support.servers import require_or_skip

SLOT = PUB = "outboxkit_outbox"


@pytest.fixture
def cdc_dsn(logical_db_dsn: str) -> str:
    slots.setup(logical_db_dsn, "outbox")
    return logical_db_dsn


def _put(dsn: str, *keys: str) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        for key in keys:
            Outbox().put(
                conn, Event(topic="orders", event_type="placed", key=key, payload={"k": key})
            )


async def _take(
    stream: ReplicationStream, commits: int, *, skip_keepalives: bool = True
) -> list[Item]:
    """Items up to and including the `commits`-th Commit (within 20 s)."""
    items: list[Item] = []

    async def collect() -> None:
        seen = 0
        async for item in stream:
            if skip_keepalives and isinstance(item, Keepalive):
                continue
            items.append(item)
            if isinstance(item, Commit):
                seen += 1
                if seen == commits:
                    return

    await asyncio.wait_for(collect(), 20)
    return items


def _keys(items: list[Item]) -> list[str | None]:
    return [(i.values["key"] or b"").decode() for i in items if isinstance(i, Row)]


async def test_inserts_and_logical_messages_arrive_decoded_and_rollbacks_never(
    cdc_dsn: str,
) -> None:
    with psycopg.connect(cdc_dsn) as conn:
        with conn.transaction():
            Outbox().put(
                conn,
                Event(topic="orders", event_type="placed", key="k1", payload=b"\x00\xffraw"),
            )
            conn.execute(
                "SELECT pg_logical_emit_message(true, 'outboxkit:outbox', %s::bytea)",
                (b"\x01envelope\x00",),
            )
        with conn.transaction():
            Outbox().put(conn, Event(topic="orders", event_type="placed", key="gone", payload={}))
            conn.execute("SELECT pg_logical_emit_message(true, 'outboxkit:outbox', 'gone')")
            raise psycopg.Rollback
    _put(cdc_dsn, "k2")
    async with ReplicationStream(cdc_dsn, SLOT, PUB) as stream:
        items = await _take(stream, 2)
    kinds = [type(i).__name__ for i in items]
    assert kinds == ["Begin", "Row", "Message", "Commit", "Begin", "Row", "Commit"]
    begin, row, message, commit = items[:4]
    assert isinstance(begin, Begin) and isinstance(commit, Commit)
    assert begin.final_lsn == commit.commit_lsn and begin.xid > 0
    assert isinstance(row, Row) and row.relation == "public.outbox"
    assert row.values["key"] == b"k1" and row.values["topic"] == b"orders"
    assert row.values["payload"] == b"\\x" + b"\x00\xffraw".hex().encode()
    assert row.values["status"] == b"0"
    assert begin.final_lsn > row.lsn > 0
    assert message == Message(True, message.lsn, "outboxkit:outbox", b"\x01envelope\x00")
    assert _keys(items) == ["k1", "k2"]  # the rolled-back transaction never appears


async def test_commit_order_across_concurrent_writers(cdc_dsn: str) -> None:
    # A starts first (lower ids) but commits after B: the stream follows the commits.
    with psycopg.connect(cdc_dsn) as a, psycopg.connect(cdc_dsn) as b:
        with a.transaction():
            Outbox().put(a, Event(topic="t", event_type="e", key="A", payload={}))
            with b.transaction():
                Outbox().put(b, Event(topic="t", event_type="e", key="B", payload={}))
    writers, per_writer = 4, 25

    def write(n: int) -> None:
        for i in range(per_writer):
            _put(cdc_dsn, f"w{n}-{i}-a", f"w{n}-{i}-b")

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    async with ReplicationStream(cdc_dsn, SLOT, PUB) as stream:
        items = await _take(stream, 2 + writers * per_writer)
    keys = _keys(items)
    assert keys[:2] == ["B", "A"]
    commits = [i.commit_lsn for i in items if isinstance(i, Commit)]
    assert commits == sorted(commits) and len(set(commits)) == len(commits)
    # each transaction arrives whole, between its Begin and its Commit
    current: list[str] = []
    for item in items:
        if isinstance(item, Begin):
            current = []
        elif isinstance(item, Row):
            current.append((item.values["key"] or b"").decode())
        elif isinstance(item, Commit) and current[0].startswith("w"):
            assert len(current) == 2 and current[0][:-1] == current[1][:-1]
    for n in range(writers):  # each writer's own transactions in its order
        mine = [k for k in keys if k.startswith(f"w{n}-") and k.endswith("-a")]
        assert mine == [f"w{n}-{i}-a" for i in range(per_writer)]


async def test_a_new_stream_resumes_at_the_confirmed_position(cdc_dsn: str) -> None:
    _put(cdc_dsn, "first")
    _put(cdc_dsn, "second")
    async with ReplicationStream(cdc_dsn, SLOT, PUB) as stream:
        items = await _take(stream, 2)
        first_commit = next(i for i in items if isinstance(i, Commit))
        stream.confirm(first_commit.end_lsn)  # "second" is received but not confirmed
    _put(cdc_dsn, "third")
    async with ReplicationStream(cdc_dsn, SLOT, PUB) as stream:
        again = await _take(stream, 2)
    assert _keys(items) == ["first", "second"]
    assert _keys(again) == ["second", "third"]  # the unconfirmed tail again, nothing lost


async def test_a_second_streamer_gets_slot_in_use_and_takes_over_when_it_frees(
    cdc_dsn: str,
) -> None:
    async with ReplicationStream(cdc_dsn, SLOT, PUB):
        with pytest.raises(SlotInUse, match="streamed by another process"):
            await ReplicationStream(cdc_dsn, SLOT, PUB).open()
    deadline = time.monotonic() + 10
    while True:  # the first one's WAL sender exits just after its connection closes
        try:
            async with ReplicationStream(cdc_dsn, SLOT, PUB):
                break
        except SlotInUse:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)


async def test_a_missing_slot_says_to_run_setup(logical_db_dsn: str) -> None:
    with pytest.raises(SlotNotFound, match="outboxkit cdc setup"):
        await ReplicationStream(logical_db_dsn, "outboxkit_nope", PUB).open()


async def test_a_killed_wal_sender_raises_connection_lost(cdc_dsn: str) -> None:
    async with ReplicationStream(cdc_dsn, SLOT, PUB) as stream:
        with psycopg.connect(cdc_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                " WHERE slot_name = %s",
                (SLOT,),
            )
        with pytest.raises(ReplicationConnectionLost, match="reconnect"):
            await _take(stream, 1)


async def test_idle_stream_yields_keepalives_and_keeps_reporting_while_the_caller_pauses(
    cdc_dsn: str,
) -> None:
    async with ReplicationStream(cdc_dsn, SLOT, PUB, status_interval=0.3) as stream:
        items = stream.__aiter__()
        first = await asyncio.wait_for(anext(items), 10)
        assert isinstance(first, Keepalive) and first.wal_end > 0
        stream.confirm(first.wal_end)

        def reply_time() -> object:
            with psycopg.connect(cdc_dsn, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT reply_time FROM pg_stat_replication r JOIN pg_replication_slots s"
                    " ON s.active_pid = r.pid WHERE s.slot_name = %s",
                    (SLOT,),
                ).fetchone()
            return row[0] if row else None

        before = reply_time()
        await asyncio.sleep(1.5)  # not reading: the stream still sends status
        assert reply_time() != before
        await _aclose(items)
    status = slots.status(cdc_dsn, "outbox", measure_seconds=False)
    assert status.confirmed_flush_lsn is not None


async def _aclose(items: AsyncIterator[Item]) -> None:
    aclose = getattr(items, "aclose", None)
    if aclose is not None:
        await aclose()


async def test_a_large_transaction_is_streamed_without_being_held_in_memory(
    cdc_dsn: str,
) -> None:
    # ~32 MB of pgoutput text by default; OUTBOXKIT_CDC_LARGE_EVENTS=100000 for the size
    events = int(os.environ.get("OUTBOXKIT_CDC_LARGE_EVENTS", "8000"))
    payload = b"p" * 2000
    with psycopg.connect(cdc_dsn) as conn, conn.transaction():
        for start in range(0, events, 10_000):  # put_many takes at most 10 000 at once
            batch = [
                Event(topic="bulk", event_type="e", key=str(i), payload=payload)
                for i in range(start, min(events, start + 10_000))
            ]
            Outbox().put_many(conn, batch)
            del batch
    process = psutil.Process()
    rows, start, peak = 0, process.memory_info().rss, 0
    async with ReplicationStream(cdc_dsn, SLOT, PUB) as stream:
        async for item in stream:
            if isinstance(item, Row):
                rows += 1
                if rows % 500 == 0:
                    peak = max(peak, process.memory_info().rss - start)
            elif isinstance(item, Commit):
                break
    assert rows == events
    streamed = events * 4000
    print(f"streamed {rows} rows ({streamed} bytes of text): RSS grew by {peak} bytes")
    assert peak < 20 * 1024 * 1024, f"RSS grew by {peak} bytes while streaming {streamed} bytes"


async def test_a_silent_network_is_a_lost_connection_after_the_timeout(
    cdc_dsn: str, proxy_factory: Callable[..., TcpProxy]
) -> None:
    port = int(cdc_dsn.rsplit(":", 1)[1].split("/", 1)[0])
    proxy = proxy_factory("127.0.0.1", port)
    via_proxy = cdc_dsn.replace(f":{port}/", f":{proxy.port}/", 1)
    async with ReplicationStream(via_proxy, SLOT, PUB, status_interval=0.5, timeout=3.0) as stream:
        items = stream.__aiter__()
        assert isinstance(await asyncio.wait_for(anext(items), 10), Keepalive)
        proxy.pause()  # packets are held, nothing is closed: only silence tells
        started = time.monotonic()
        with pytest.raises(ReplicationConnectionLost, match="sent nothing"):
            await asyncio.wait_for(_drain(items), 20)
        assert time.monotonic() - started < 10
        proxy.resume()


async def _drain(items: AsyncIterator[Item]) -> None:
    async for _ in items:
        pass


@pytest.fixture
def strict_sender_dsn() -> Iterator[str]:
    """A logical server that ends a WAL sender after 2 s without a status from its client."""
    from outboxkit.backends.postgres.migrate import migrate

    try:
        server = EmbeddedPostgres(fsync=False, logical=True, settings={"wal_sender_timeout": "2s"})
        server.start()
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"embedded PostgreSQL unavailable: {exc}")
    try:
        migrate(server.dsn, table="outbox")
        slots.setup(server.dsn, "outbox")
        yield server.dsn
    finally:
        server.close()


async def test_a_paused_caller_keeps_the_slot_where_a_naive_client_is_timed_out(
    strict_sender_dsn: str,
) -> None:
    import psycopg2
    import psycopg2.extras

    # naive: psycopg2 answers the server only from read_message(); a caller that stops
    # reading (a broker outage) is cut off by wal_sender_timeout
    naive = psycopg2.connect(
        strict_sender_dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection
    )
    try:
        cursor = naive.cursor()
        cursor.start_replication(slot_name=SLOT, decode=False, options={
            "proto_version": "1", "publication_names": PUB, "messages": "true"})  # fmt: skip
        await asyncio.sleep(4)
        with pytest.raises(psycopg2.Error):
            for _ in range(100):
                cursor.read_message()
                await asyncio.sleep(0.05)
    finally:
        naive.close()
    await asyncio.sleep(0.5)  # its WAL sender lets go of the slot
    async with ReplicationStream(strict_sender_dsn, SLOT, PUB, status_interval=0.5) as stream:
        items = stream.__aiter__()
        await asyncio.wait_for(anext(items), 10)
        await asyncio.sleep(4)  # not reading, twice the server's timeout
        _put(strict_sender_dsn, "after-the-pause")
        rows: list[Item] = []
        while not any(isinstance(i, Commit) for i in rows):
            rows.append(await asyncio.wait_for(anext(items), 10))
        assert _keys(rows) == ["after-the-pause"]
        await _aclose(items)


async def test_postgresql_restarted_under_the_stream_loses_nothing_after_reconnect() -> None:
    from outboxkit.backends.postgres.migrate import migrate

    try:
        server = EmbeddedPostgres(logical=True)  # fsync on: committed events survive
        server.start()
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"embedded PostgreSQL unavailable: {exc}")
    try:
        migrate(server.dsn, table="outbox")
        slots.setup(server.dsn, "outbox")
        _put(server.dsn, "before")
        async with ReplicationStream(server.dsn, SLOT, PUB) as stream:
            first = await _take(stream, 1)
            await asyncio.to_thread(server.restart, "immediate")  # a crash, not a shutdown
            _put(server.dsn, "after")
            with pytest.raises(ReplicationConnectionLost):
                await asyncio.wait_for(_drain(stream.__aiter__()), 20)
        async with ReplicationStream(server.dsn, SLOT, PUB) as stream:
            again = await _take(stream, 2)
    finally:
        server.close()
    assert _keys(first) == ["before"]
    assert _keys(again) == ["before", "after"]  # never confirmed: delivered again, in order


async def test_a_keepalive_never_confirms_a_transaction_read_but_not_confirmed(
    cdc_dsn: str,
) -> None:
    """psycopg2 moves the flush position it reports to a keepalive's WAL end once the caller
    has confirmed the start of the last message read. A transaction that began before the
    confirmed commit starts its messages below it, so a keepalive read among them reported
    every transaction read since as flushed: T2 here, read and never confirmed, would be
    skipped by the next stream (lost, had the relay died before publishing it). The stream
    reads no further while that can happen, until the caller confirms what it read."""
    payload = b"p" * 1000
    with psycopg.connect(cdc_dsn) as big:  # T3: writes first (~20 MB), commits last
        for start in range(0, 20_000, 10_000):
            Outbox().put_many(
                big,
                [
                    Event(topic="bulk", event_type="e", key=f"b{i}", payload=payload)
                    for i in range(start, start + 10_000)
                ],
            )
        _put(cdc_dsn, "t1")
        _put(cdc_dsn, "t2")
        big.commit()
    async with ReplicationStream(cdc_dsn, SLOT, PUB, status_interval=1.0) as stream:
        items = stream.__aiter__()
        ends: list[int] = []
        while len(ends) < 2:  # T1 and T2, whole
            item = await asyncio.wait_for(anext(items), 20)
            if isinstance(item, Commit):
                ends.append(item.end_lsn)
        t1_end, t2_end = ends
        stream.confirm(t1_end)  # T1 published; T2 not yet
        rows = 0

        async def read_t3() -> None:
            nonlocal rows
            async for item in items:
                if isinstance(item, Row):
                    rows += 1
                    if rows == 10:
                        await asyncio.sleep(3)  # the walsender blocks mid-T3, answers status
                elif isinstance(item, Commit):
                    return

        reading = asyncio.create_task(read_t3())
        await asyncio.sleep(8)  # keepalives come and psycopg2 reports what it takes as flushed
        assert slot_confirmed(cdc_dsn, SLOT) < t2_end, (
            "T2 confirmed without the caller confirming it"
        )
        assert not reading.done() and rows <= 1  # waits for T2's confirm before reading on
        stream.confirm(t2_end)
        await asyncio.wait_for(reading, 60)
        assert rows == 20_000
