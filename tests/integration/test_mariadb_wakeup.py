"""The in-process wake-up on MariaDB (no LISTEN/NOTIFY): an idle relay polling every 30 s
publishes an event written through outboxkit in its own process within moments of the
COMMIT (``transaction()``, ``atransaction()``, ``put`` then the caller's ``commit()``), while
a row committed behind outboxkit's back waits for the poll. The latency itself is measured
in bench/mariadb.py (``--only latency``), not here."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest
from pymysql.constants import CLIENT

from outboxkit import Event, Outbox, Relay
from outboxkit.backends.mariadb import wakeup
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.drivers.base import dbapi_params
from outboxkit.queue.store import QueueStore
from outboxkit.relay.polling import PollingSource
from outboxkit.write.mariadb_table import MariaDBTableStorage
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database, driver_module
from tests.support.relaying import TimingPublisher, running_relay, wait_for

POLL = 30.0  # the relay's poll interval: a wake-up is the only way to be quick
QUICK = 3.0  # what "at once" must beat by far, on a loaded machine


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    with database(mariadb_server, "wk", migrate) as url:
        yield url


def _connect(url: str, **options: Any) -> Any:
    return pymysql.connect(**connect_args(url), client_flag=CLIENT.MULTI_STATEMENTS, **options)


def _event(topic: str, **extra: Any) -> Event:
    return Event(topic=topic, event_type="x", payload={"n": 1}, **extra)


def _store(relay: Relay) -> QueueStore[Any]:
    source = relay._source
    assert isinstance(source, PollingSource)
    return source.store


async def _idle(relay: Relay) -> None:
    """Until the relay waits for a wake-up (it holds the gate): only the poll is left."""
    store = _store(relay)
    await wait_for(lambda: store.gate_closed, timeout=10)


async def _published(publisher: TimingPublisher, event: Event, since: float) -> float:
    await wait_for(lambda: event.event_id in publisher.at, timeout=QUICK, interval=0.005)
    return publisher.at[event.event_id] - since


def _commit_with_transaction(url: str, event: Event) -> float:
    conn = _connect(url)
    try:
        with Outbox(storage="mariadb").transaction(conn) as tx:
            tx.put(event)
        return time.monotonic()
    finally:
        conn.close()


def _insert_behind_outboxkits_back(url: str, event: Event) -> None:
    """The same row, written by SQL outboxkit does not see (another process's writer)."""
    storage = MariaDBTableStorage("outbox")
    stmt, params = storage.insert([storage.row(event)])
    conn = _connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute(stmt.text, dbapi_params(params))
        conn.commit()
    finally:
        conn.close()


async def test_an_idle_relay_publishes_a_transaction_at_once_and_a_foreign_row_at_its_poll(
    url: str,
) -> None:
    publisher = TimingPublisher()
    async with running_relay(url, publisher, poll_interval=POLL) as relay:
        await _idle(relay)
        foreign = _event("foreign")
        await asyncio.to_thread(_insert_behind_outboxkits_back, url, foreign)
        await asyncio.sleep(1.0)  # the naive path: nothing wakes the relay
        assert foreign.event_id not in publisher.at
        # A writer thread (a web request) commits through transaction(): the relay, on
        # the event loop, is woken across threads and takes both.
        mine = _event("mine")
        committed = await asyncio.to_thread(_commit_with_transaction, url, mine)
        assert await _published(publisher, mine, committed) < QUICK
        assert foreign.event_id in publisher.at


async def test_put_then_the_callers_commit_wakes_the_relay_which_re_polls_until_it_commits(
    url: str,
) -> None:
    publisher = TimingPublisher()
    async with running_relay(url, publisher, poll_interval=POLL) as relay:
        await _idle(relay)
        event = _event("put")

        def write() -> float:
            conn = _connect(url)
            try:
                Outbox(storage="mariadb").put(conn, event)
                time.sleep(0.3)  # the rest of the caller's transaction
                conn.commit()
                return time.monotonic()
            finally:
                conn.close()

        committed = await asyncio.to_thread(write)
        assert await _published(publisher, event, committed) < QUICK
        await _idle(relay)  # the re-polls end: it waits for a wake-up again


async def test_an_async_writer_on_the_relays_event_loop_wakes_it(url: str) -> None:
    asyncmy = driver_module("asyncmy")
    publisher = TimingPublisher()
    async with running_relay(url, publisher, poll_interval=POLL) as relay:
        await _idle(relay)
        conn = await asyncmy.connect(**connect_args(url))
        try:
            event = _event("async")
            async with Outbox(storage="mariadb").atransaction(conn) as tx:
                tx.put(event)
            assert await _published(publisher, event, time.monotonic()) < QUICK
        finally:
            conn.close()


async def test_a_scheduled_event_wakes_nobody_and_no_relay_means_no_work(url: str) -> None:
    wakeup._tables.clear()  # (no relay of an earlier test left in this process)
    assert not wakeup.has_relays()
    conn = _connect(url)
    try:  # no relay in the process: the writer pays a truth test, nothing is registered
        with Outbox(storage="mariadb").transaction(conn) as tx:
            tx.put(_event("no.relay"))
        assert not wakeup.has_relays()
    finally:
        conn.close()
    publisher = TimingPublisher()
    async with running_relay(url, publisher, poll_interval=POLL) as relay:
        await _idle(relay)
        later = _event("later", delay=dt.timedelta(seconds=60))
        await asyncio.to_thread(_commit_with_transaction, url, later)
        await asyncio.sleep(0.2)
        assert _store(relay).gate_closed  # not woken: the event is not due
