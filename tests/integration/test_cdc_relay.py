"""The WAL relay (`--source cdc`) against a PostgreSQL with wal_level=logical and real brokers.

Invariants are checked from the broker's side: what arrived, in which order, how often.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from typing import Any

import psycopg

from outboxkit import Event, Outbox, Relay
from outboxkit.backends.postgres import admin
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.testing import free_port
from tests.support.cdc_relaying import (
    RelayProcess,
    peak_rss_kib,
    running_cdc_relay,
    setup_cdc,
    slot_active,
    slot_lag,
    write_wal,
)
from tests.support.relaying import count, make_events, rows, wait_for, write_events
from tests.support.servers import consume_kafka, consume_nats, ensure_stream


def _topic(prefix: str = "orders") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def _nats_stream(url: str) -> str:
    root = f"cdc{uuid.uuid4().hex[:8]}"
    await ensure_stream(url, root.upper(), [f"{root}.>"])
    return root


# -- end to end ---------------------------------------------------------------------


async def test_table_inserts_and_wal_messages_arrive_at_nats_in_commit_order(
    logical_db_dsn: str, nats_server: Any
) -> None:
    slot = setup_cdc(logical_db_dsn)
    root = await _nats_stream(nats_server.url)
    table_events = make_events(f"{root}.orders", 20)
    wal_events = make_events(f"{root}.orders", 20)
    write_events(logical_db_dsn, table_events[:10])
    write_wal(logical_db_dsn, wal_events[:10])
    write_events(logical_db_dsn, table_events[10:])
    write_wal(logical_db_dsn, wal_events[10:])
    expected = table_events[:10] + wal_events[:10] + table_events[10:] + wal_events[10:]
    async with running_cdc_relay(logical_db_dsn, NatsPublisher.from_url(nats_server.url)) as relay:
        await wait_for(lambda: relay.stats.published == 40, what="40 published")
        # the table source never updates a row: published rows leave in bulk
        await wait_for(lambda: count(logical_db_dsn) == 0, what="table rows removed")
        await wait_for(lambda: slot_lag(logical_db_dsn, slot) < 1024, what="slot confirmed")
    msgs = await _stored(nats_server.url, root)
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == [str(e.event_id) for e in expected]
    for m, e in zip(msgs, expected, strict=True):
        assert m.data == e.payload
        assert m.subject == e.topic
        assert m.headers["ce-type"] == "order.placed"
        assert m.headers["tenant"] == "acme"
        assert m.headers["ce-partitionkey"] == e.key
        assert m.headers["ce-traceparent"] == e.headers["traceparent"]


async def test_both_sources_arrive_at_kafka_with_key_headers_and_payload_bytes_through_relay(
    logical_db_dsn: str, kafka_broker: Any
) -> None:
    setup_cdc(logical_db_dsn)
    topic = _topic()
    table_events = make_events(topic, 15)
    wal_events = make_events(topic, 15)
    write_events(logical_db_dsn, table_events)
    write_wal(logical_db_dsn, wal_events)
    publisher = KafkaPublisher.from_url(kafka_broker.url)
    relay = Relay(logical_db_dsn, publisher, source="cdc", retry_base=0.05, retry_cap=0.5)
    task = asyncio.create_task(relay.run())
    try:
        await wait_for(lambda: relay.stats.published == 30, what="30 published")
    finally:
        relay.stop()
        await asyncio.wait_for(task, 30)
    messages = await asyncio.to_thread(consume_kafka, kafka_broker.bootstrap, topic, 30, 20.0)
    by_id = {dict(m.headers())["idempotency-key"].decode(): m for m in messages}
    assert len(by_id) == 30
    for e in table_events + wal_events:
        m = by_id[str(e.event_id)]
        headers = {k: v.decode() for k, v in m.headers()}
        assert m.key() == e.key.encode()  # type: ignore[union-attr]
        assert m.value() == e.payload
        assert headers["ce_id"] == str(e.event_id)
        assert headers["ce_subject"] == e.aggregate_id
        assert headers["tenant"] == "acme"
        assert headers["traceparent"] == e.headers["traceparent"]
    for key in {e.key for e in table_events}:  # commit order within each key (partition)
        in_kafka = [m for m in messages if m.key() == key.encode()]  # type: ignore[union-attr]
        ids = [dict(m.headers())["idempotency-key"].decode() for m in in_kafka]
        assert ids == [str(e.event_id) for e in table_events + wal_events if e.key == key]


async def test_rolled_back_transactions_are_never_published(
    logical_db_dsn: str, nats_server: Any
) -> None:
    setup_cdc(logical_db_dsn)
    root = await _nats_stream(nats_server.url)
    rolled_back = make_events(f"{root}.orders", 6)
    committed = make_events(f"{root}.orders", 4)
    with psycopg.connect(logical_db_dsn) as conn:
        Outbox().put_many(conn, rolled_back[:3])
        conn.rollback()
    write_wal(logical_db_dsn, rolled_back[3:], rollback=True)
    write_events(logical_db_dsn, committed[:2])
    write_wal(logical_db_dsn, committed[2:])
    async with running_cdc_relay(logical_db_dsn, NatsPublisher.from_url(nats_server.url)) as relay:
        await wait_for(lambda: relay.stats.published == 4, what="4 published")
        await asyncio.sleep(0.5)
        assert relay.stats.published == 4
    msgs = await _stored(nats_server.url, root)
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == [str(e.event_id) for e in committed]


def _writer(dsn: str, topic: str, writer: int, n: int, wal: bool) -> None:
    """Transactions whose commit order is known: each takes one lock, numbers itself from a
    sequence, writes its event and commits while still holding the lock."""
    with psycopg.connect(dsn) as conn:
        for i in range(n):
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(42)")
                row = conn.execute("SELECT nextval('commit_order')").fetchone()
                assert row is not None
                event = Event(
                    topic=topic,
                    event_type="tick",
                    payload={"commit": row[0], "writer": writer, "i": i},
                    key=f"w{writer}",
                )
                if wal:
                    from outboxkit.write.wal_envelope import encode_envelope, message_prefix

                    conn.execute(
                        "SELECT pg_logical_emit_message(true, %s, %s)",
                        (message_prefix("outbox"), encode_envelope(event)),
                    )
                else:
                    Outbox().put(conn, event)


async def test_events_arrive_in_commit_order_across_concurrent_writers(
    logical_db_dsn: str, nats_server: Any
) -> None:
    import orjson

    setup_cdc(logical_db_dsn)
    with psycopg.connect(logical_db_dsn, autocommit=True) as conn:
        conn.execute("CREATE SEQUENCE commit_order")
    root = await _nats_stream(nats_server.url)
    topic = f"{root}.ticks"
    async with running_cdc_relay(
        logical_db_dsn, NatsPublisher.from_url(nats_server.url), batch_size=50
    ) as relay:
        threads = [
            threading.Thread(target=_writer, args=(logical_db_dsn, topic, w, 60, w % 2 == 1))
            for w in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            await asyncio.to_thread(t.join)
        await wait_for(lambda: relay.stats.published == 360, what="360 published")
    msgs = await consume_nats(nats_server.url, root.upper(), f"{root}.>", 360, 20.0)
    order = [orjson.loads(m.data)["commit"] for m in msgs]
    assert order == list(range(1, 361))


# -- failures -----------------------------------------------------------------------


async def test_a_failing_event_is_retried_dead_lettered_into_the_table_then_replayed(
    logical_db_dsn: str, nats_server: Any
) -> None:
    slot = setup_cdc(logical_db_dsn)
    root = await _nats_stream(nats_server.url)
    poison_root = f"cdc{uuid.uuid4().hex[:8]}"  # no stream stores it yet: every try fails
    before = make_events(f"{root}.orders", 3)
    poison = Event(topic=f"{poison_root}.orders", event_type="x", payload=b"\x00poison")
    after = make_events(f"{root}.orders", 3)
    write_events(logical_db_dsn, before)
    write_wal(logical_db_dsn, [poison])
    write_events(logical_db_dsn, after)
    async with running_cdc_relay(
        logical_db_dsn, NatsPublisher.from_url(nats_server.url), max_attempts=3
    ) as relay:
        await wait_for(lambda: relay.stats.dead_lettered == 1, what="dead-lettered")
        await wait_for(lambda: relay.stats.published == 6, what="the stream moved on")
        assert relay.stats.retried == 2
        [dead] = rows(logical_db_dsn, "status = 2")
        assert (dead["event_id"], dead["attempts"], bytes(dead["payload"])) == (
            poison.event_id,
            3,
            b"\x00poison",
        )
        assert "no JetStream stream" in dead["last_error"]
        await wait_for(lambda: slot_lag(logical_db_dsn, slot) < 1024, what="slot moved past it")
        # the broker is fixed; replay puts the event back where the stream sees it
        await ensure_stream(nats_server.url, poison_root.upper(), [f"{poison_root}.>"])
        assert admin.replay(logical_db_dsn, ids=[dead["id"]]) == 1
        await wait_for(lambda: relay.stats.published == 7, what="the replayed event")
        await wait_for(lambda: count(logical_db_dsn) == 0, what="table emptied")
    msgs = await _stored(nats_server.url, root)
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == [str(e.event_id) for e in before + after]
    [replayed] = await _stored(nats_server.url, poison_root)
    assert (replayed.headers["Nats-Msg-Id"], replayed.data) == (str(poison.event_id), b"\x00poison")


# -- processes killed, servers restarted --------------------------------------------


async def _stored(url: str, root: str) -> list[Any]:
    """Every message the stream stores, in stream order (the relays have stopped)."""
    return await consume_nats(url, root.upper(), f"{root}.>", None, 20.0)


async def _nats_ids(url: str, root: str, n: int | None = None, timeout: float = 20.0) -> list[str]:
    """The ids of the first ``n`` messages (None: all that are stored, see ``_stored``)."""
    if n is None:
        msgs = await _stored(url, root)
    else:
        msgs = await consume_nats(url, root.upper(), f"{root}.>", n, timeout)
    return [m.headers["Nats-Msg-Id"] for m in msgs]


async def _stream_count(url: str, root: str) -> int:
    import nats

    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(root.upper())
        return int(info.state.messages)
    finally:
        await nc.close()


async def test_a_relay_sigkilled_mid_stream_loses_nothing_and_nats_absorbs_the_tail(
    logical_db_dsn: str, nats_server: Any
) -> None:
    slot = setup_cdc(logical_db_dsn)
    root = await _nats_stream(nats_server.url)
    events = make_events(f"{root}.orders", 3000)
    for i in range(0, 3000, 100):  # 30 transactions, both sources
        if i % 200:
            write_wal(logical_db_dsn, events[i : i + 100])
        else:
            write_events(logical_db_dsn, events[i : i + 100])
    first = RelayProcess(logical_db_dsn, nats_server.url, "--batch-size", "100")
    try:
        await wait_for(
            lambda: _stream_count(nats_server.url, root),
            timeout=30,
            what="the first relay published something",
        )
        await wait_for(
            lambda: _over(_stream_count(nats_server.url, root), 600), timeout=30, what="600"
        )
    finally:
        first.kill()
    killed_at = await _stream_count(nats_server.url, root)
    assert killed_at < 3000, "the relay finished before it was killed: nothing was tested"
    second = RelayProcess(logical_db_dsn, nats_server.url, "--batch-size", "100")
    try:
        await wait_for(
            lambda: _over(_stream_count(nats_server.url, root), 2999), timeout=60, what="all"
        )
        await wait_for(lambda: slot_lag(logical_db_dsn, slot) < 4096, what="slot confirmed")
    finally:
        second.stop()
    assert count(logical_db_dsn) == 0, "a published row was left behind as pending"
    ids = await _nats_ids(nats_server.url, root)
    # none lost, none twice: the re-published tail was absorbed by Nats-Msg-Id
    assert ids == [str(e.event_id) for e in events], first.output + second.output


def _metric(port: int, name: str) -> float | None:
    """One unlabelled sample of the relay's /metrics (None while it does not answer)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def _over(value: Any, n: int) -> bool:
    return int(await value) > n


async def test_a_standby_relay_takes_over_within_seconds_of_the_active_one_being_sigkilled(
    logical_db_dsn: str, nats_server: Any
) -> None:
    slot = setup_cdc(logical_db_dsn)
    root = await _nats_stream(nats_server.url)
    active = RelayProcess(logical_db_dsn, nats_server.url)
    standby: RelayProcess | None = None
    try:
        await wait_for(lambda: slot_active(logical_db_dsn, slot), what="the active relay streams")
        port = free_port()
        standby = RelayProcess(logical_db_dsn, nats_server.url, "--metrics-port", str(port))
        early = make_events(f"{root}.orders", 10)
        write_events(logical_db_dsn, early)
        await wait_for(lambda: _over(_stream_count(nats_server.url, root), 9), what="early")
        await wait_for(
            lambda: standby is not None and standby.logged("standby: slot outboxkit_outbox"),
            timeout=60,
            what="the standby waits",
        )
        await wait_for(lambda: _metric(port, "outboxkit_cdc_streaming") == 0.0, what="metrics")
        await wait_for(lambda: _metric(port, "outboxkit_cdc_standby") == 1.0, what="standby")
        active.kill()
        killed = time.monotonic()
        late = make_events(f"{root}.orders", 10)
        write_wal(logical_db_dsn, late)
        await wait_for(
            lambda: _over(_stream_count(nats_server.url, root), 19), timeout=30, what="late"
        )
        takeover = time.monotonic() - killed
        # the gauges follow at their next refresh (every gauge interval)
        await wait_for(
            lambda: _metric(port, "outboxkit_cdc_streaming") == 1.0, what="streaming gauge"
        )
        assert _metric(port, "outboxkit_cdc_standby") == 0.0
        await wait_for(
            lambda: (_metric(port, "outboxkit_cdc_confirmed_lsn") or 0) > 0, what="confirmed gauge"
        )
        assert _metric(port, "outboxkit_cdc_lag_seconds") is not None
    finally:
        active.kill()
        if standby is not None:
            standby.stop()
    assert standby is not None
    assert takeover < 5, active.output + standby.output
    ids = await _nats_ids(nats_server.url, root)
    assert ids == [str(e.event_id) for e in early + late]


async def test_the_relay_reconnects_and_resumes_when_postgresql_restarts_under_it(
    nats_server: Any,
) -> None:
    from outboxkit.backends.postgres.migrate import migrate
    from outboxkit.testing import EmbeddedPostgres

    pg = EmbeddedPostgres(logical=True)  # fsync on: committed events survive the restart
    pg.start()
    try:
        dsn = pg.dsn
        migrate(dsn)
        setup_cdc(dsn)
        root = await _nats_stream(nats_server.url)
        before = make_events(f"{root}.orders", 20)
        after = make_events(f"{root}.orders", 20)
        write_events(dsn, before)
        async with running_cdc_relay(dsn, NatsPublisher.from_url(nats_server.url)) as relay:
            await wait_for(lambda: relay.stats.published == 20, what="before the restart")
            await asyncio.to_thread(pg.restart, "fast")
            write_wal(dsn, after[:10])
            write_events(dsn, after[10:])
            await wait_for(lambda: relay.stats.published >= 40, timeout=30, what="after")
            assert relay.stats.db_reconnects >= 1
            # the bulk delete reconnects too: no published row is left pending
            await wait_for(lambda: count(dsn) == 0, what="published rows removed")
    finally:
        pg.close()
    ids = await _nats_ids(nats_server.url, root)
    assert ids == [str(e.event_id) for e in before + after]


async def test_a_broker_outage_pauses_the_stream_and_holds_the_wal_then_it_drains(
    logical_db_dsn: str, fresh_nats: Any
) -> None:
    slot = setup_cdc(logical_db_dsn)
    root = await _nats_stream(fresh_nats.url)
    events = make_events(f"{root}.orders", 50)
    async with running_cdc_relay(
        logical_db_dsn, NatsPublisher.from_url(fresh_nats.url), max_attempts=2
    ) as relay:
        write_events(logical_db_dsn, events[:10])
        await wait_for(lambda: relay.stats.published == 10, what="before the outage")
        await asyncio.to_thread(fresh_nats.stop)
        write_events(logical_db_dsn, events[10:30])
        write_wal(logical_db_dsn, events[30:])
        await wait_for(lambda: relay.stats.released > 0, what="events handed back")
        await asyncio.sleep(2.0)
        assert relay.stats.dead_lettered == 0  # an outage never uses up attempts
        assert slot_lag(logical_db_dsn, slot) > 0  # the slot holds the unpublished WAL
        await asyncio.to_thread(fresh_nats.start)
        await wait_for(lambda: relay.stats.published >= 50, timeout=60, what="drained")
        await wait_for(lambda: slot_lag(logical_db_dsn, slot) < 1024, what="slot confirmed")
    ids = await _nats_ids(fresh_nats.url, root)
    assert ids == [str(e.event_id) for e in events]
    assert count(logical_db_dsn, "status = 2") == 0


async def test_an_idle_relay_advances_the_slot_while_other_databases_write(
    logical_db_dsn: str, logical_pg: str, nats_server: Any
) -> None:
    slot = setup_cdc(logical_db_dsn)
    async with running_cdc_relay(logical_db_dsn, NatsPublisher.from_url(nats_server.url)):
        await wait_for(lambda: slot_active(logical_db_dsn, slot), what="streaming")
        with psycopg.connect(logical_pg, autocommit=True) as conn:  # another database
            table = f"churn_{uuid.uuid4().hex[:8]}"
            conn.execute(f"CREATE TABLE {table} (x text)")
            try:
                for _ in range(20):
                    conn.execute(
                        f"INSERT INTO {table} SELECT md5(g::text) FROM generate_series(1, 20000) g"
                    )
                lag = slot_lag(logical_db_dsn, slot)
                assert lag > 1_000_000, lag  # megabytes of WAL written elsewhere
                await wait_for(
                    lambda: slot_lag(logical_db_dsn, slot) < 100_000, timeout=30, what="advance"
                )
            finally:
                conn.execute(f"DROP TABLE {table}")


async def test_a_large_transaction_is_relayed_with_bounded_memory(
    logical_db_dsn: str, nats_server: Any
) -> None:
    """Peak RSS of the relay process for one 20 000-event transaction vs a 2 000-event one
    (OUTBOXKIT_CDC_BIG=100000 for the issue's 100 000 vs 10 000)."""
    big = int(os.environ.get("OUTBOXKIT_CDC_BIG", "20000"))
    peaks = []
    for n in (big // 10, big):
        root = await _nats_stream(nats_server.url)
        events = make_events(f"{root}.orders", n)
        setup_cdc(logical_db_dsn)
        with psycopg.connect(logical_db_dsn) as conn:
            for i in range(0, n, 5000):
                Outbox().put_many(conn, events[i : i + 5000])
            conn.commit()
        proc = RelayProcess(logical_db_dsn, nats_server.url)
        try:
            await wait_for(
                lambda root=root, n=n: _over(_stream_count(nats_server.url, root), n - 1),
                timeout=120,
                what=f"{n} events",
            )
            peaks.append(peak_rss_kib(proc.pid))
        finally:
            proc.stop()
        with psycopg.connect(logical_db_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot('outboxkit_outbox')")
            conn.execute("TRUNCATE outbox")
    print(f"peak RSS: {big // 10} events {peaks[0]} KiB, {big} events {peaks[1]} KiB")
    assert peaks[1] < peaks[0] * 1.3 + 20_000, peaks


async def test_a_partitioned_table_source_is_relayed_and_its_partitions_dropped_not_deleted(
    logical_db_dsn: str, nats_server: Any
) -> None:
    from outboxkit.backends.postgres.migrate import migrate

    with psycopg.connect(logical_db_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE outbox")
    migrate(logical_db_dsn, partition_by="minute")
    setup_cdc(logical_db_dsn)
    root = await _nats_stream(nats_server.url)
    events = make_events(f"{root}.orders", 10)
    write_events(logical_db_dsn, events)
    async with running_cdc_relay(logical_db_dsn, NatsPublisher.from_url(nats_server.url)) as relay:
        await wait_for(lambda: relay.stats.published == 10, what="published")
        assert relay.cleanup.partitioned
        await asyncio.sleep(1.0)
        assert count(logical_db_dsn) == 10  # no row deleted or updated: partitions go whole
        relay.cleanup.partition_interval = 0.0
        await relay.cleanup.flush()  # drops nothing young enough to still be current
        assert count(logical_db_dsn) == 10
    assert await _nats_ids(nats_server.url, root) == [str(e.event_id) for e in events]


async def test_the_bulk_delete_waits_for_the_inserting_transaction_to_become_visible(
    logical_db_dsn: str,
) -> None:
    """The stream delivers a transaction once its commit record is flushed, a moment before a
    new snapshot sees it, so a DELETE then missed its rows (the demo's leftover rows). A
    transaction held open stands in for that moment: the bulk delete waits for it (and keeps
    the row for a later pass, holding the confirm, past its bound); a row gone already is
    not waited for."""
    from outboxkit.cdc.cleanup import Cleanup

    cleanup = Cleanup(logical_db_dsn, "outbox")
    late, early = make_events("orders", 2)
    try:
        with psycopg.connect(logical_db_dsn) as writer:
            Outbox().put(writer, late)
            row = writer.execute(
                "SELECT id, pg_current_xact_id()::text::bigint %% 4294967296 FROM outbox"
                " WHERE event_id = %s",
                (late.event_id,),
            ).fetchone()
            assert row is not None
            cleanup.add([(row[0], row[1]), (10**12, row[1])])  # and an id gone already
            started = time.monotonic()
            assert await cleanup.flush(force=True) is False  # not visible within the bound
            assert time.monotonic() - started >= 0.9
            flushing = asyncio.create_task(cleanup.flush(force=True))
            await asyncio.sleep(0.3)
            assert not flushing.done(), "the delete did not wait for the open transaction"
            writer.commit()
            assert await flushing is True
        assert count(logical_db_dsn) == 0, "the row committed meanwhile was not deleted"
        write_events(logical_db_dsn, [early])
        with psycopg.connect(logical_db_dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT id, xmin::text::bigint FROM outbox WHERE event_id = %s", (early.event_id,)
            ).fetchone()
        assert row is not None
        cleanup.add([(row[0], row[1]), (10**12, row[1])])
        started = time.monotonic()
        assert await cleanup.flush(force=True) is True
        assert time.monotonic() - started < 0.5  # visible: the missing id is gone, no wait
        assert count(logical_db_dsn) == 0
    finally:
        await cleanup.close()
