"""The testing kit's helpers given a MariaDB URL (the private mariadbd, PyMySQL writes): the
same assertions, relay drain, inbox redelivery and inline tasks as on PostgreSQL, each
reading and writing through the URL's backend. The fixtures (``outboxkit_postgres`` and
those built on it) stay PostgreSQL's: they clone databases on an embedded server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outboxkit import Outbox
from outboxkit.backends import backend_for
from outboxkit.publishers.memory import MemoryBroker
from outboxkit.pytest import InboxKit, KitRelay, OutboxEvents, TaskKit, received_event
from tests.integration.test_testing_kit import order_event
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import SYNC, database, driver_module
from tests.support.mariadb_ops import mariadb_execute

outbox = Outbox()


def _migrate(url: str) -> None:
    backend = backend_for(url)
    backend.migrate(url, "outbox", "outbox")
    backend.migrate(url, "inbox", "processed_events")


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    driver_module("pymysql")
    with database(mariadb_server, "kit", _migrate) as url:
        yield url


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    name = f"kit-{uuid.uuid4().hex[:10]}"
    yield MemoryBroker.named(name)
    MemoryBroker.forget(name)


def _transaction(url: str) -> Any:
    """A PyMySQL connection in a transaction, committed at the end (rolled back on error)."""
    from outboxkit.backends.mariadb.sql import connect_args

    return SYNC[0].transaction(connect_args(url), url)


def _place(url: str, order: int, *, fail: bool = False) -> None:
    with _transaction(url) as conn:
        outbox.put(conn, order_event(order))
        if fail:
            raise RuntimeError("the business change failed")


def test_outbox_events_and_drain_read_and_relay_a_mariadb_outbox(
    url: str, broker: MemoryBroker
) -> None:
    """Before, the kit read the outbox with PostgreSQL's admin, which cannot open a
    mysql:// URL; now it asks the URL's backend."""
    from outboxkit.backends.postgres.admin import list_events

    with pytest.raises(Exception):  # the driver's own error, whatever it is
        list_events(url, "outbox")  # the naive read

    events = OutboxEvents(url)
    _place(url, 1)
    with pytest.raises(RuntimeError):
        _place(url, 2, fail=True)
    event = events.assert_published(
        event_type="order.placed", key="customer-1", payload={"order": 1}
    )
    events.assert_not_published(payload={"order": 2})
    assert event.aggregate_id == "1"

    relay = KitRelay(url, broker)
    broker.fail(1, topic="orders")  # one failure on cue: retried, then published
    [message] = relay.drain()
    assert (message.key, message.attempt) == ("customer-1", 2)
    assert message.headers["ce_id"] == str(event.event_id)
    assert relay.received()[0].json()["order"] == 1
    assert events.rows()[0].status == "published"

    _place(url, 3)
    broker.fail(permanent=True, error="schema registry said no")
    assert relay.drain() == []
    row = events.rows()[-1]
    assert (row.status, row.event.key) == ("failed", "customer-3")
    assert "schema registry said no" in (row.last_error or "")


async def test_deliver_twice_on_mariadb_applies_the_handlers_write_once(url: str) -> None:
    driver_module("aiomysql")
    mariadb_execute(url, "CREATE TABLE invoices (order_id INT)")

    async def invoice(conn: Any, event: Any) -> None:  # an aiomysql connection, in its tx
        async with conn.cursor() as cur:
            await cur.execute("INSERT INTO invoices VALUES (%s)", (event.json()["order"],))

    kit = InboxKit(url)
    event = received_event(topic="orders", event_type="order.placed", payload={"order": 5})
    assert (await kit.deliver_twice(invoice, event)).fresh == [True, False]
    assert mariadb_execute(url, "SELECT COUNT(*) FROM invoices") == [(1,)]

    async def fails(conn: Any, event: Any) -> None:
        await invoice(conn, event)
        raise RuntimeError("the handler failed: its write and the inbox record roll back")

    other = received_event(topic="orders", event_type="order.placed", payload={"order": 6})
    with pytest.raises(RuntimeError):
        await kit.deliver(fails, other)
    assert await kit.deliver(invoice, other)  # not recorded by the failed delivery
    assert mariadb_execute(url, "SELECT order_id FROM invoices ORDER BY 1") == [(5,), (6,)]


def test_run_pending_on_mariadb_runs_the_tasks_with_the_workers_retries(url: str) -> None:
    from outboxkit.queue.tasks import TaskStatus
    from outboxkit.tasks import Tasks

    tasks = Tasks()
    ran: list[str] = []

    @tasks.handler("report.generate", retry=[0], max_attempts=3)
    def generate(payload: dict[str, int]) -> None:
        ran.append("report")
        if ran.count("report") == 1:
            raise RuntimeError("the first attempt fails")

    kit = TaskKit(url)
    kit.run_pending(tasks)  # migrates MariaDB's task table, runs nothing
    with _transaction(url) as conn:
        tasks.enqueue(conn, "report.generate", {"n": 1})
    [row] = kit.run_pending(tasks)
    assert (row["status"], row["attempts"]) == (TaskStatus.DONE, 2)
    assert ran == ["report", "report"]


def test_scratch_databases_on_mariadb_are_made_and_dropped_under_an_open_transaction(
    mariadb_server: MariaDB,
) -> None:
    """``create_database`` / ``drop_database`` follow the URL. The drop disconnects a session
    left in a transaction on the database first: a plain DROP DATABASE would wait for its
    metadata lock (``lock_wait_timeout``, a year by default)."""
    import time

    from outboxkit.errors import ConfigurationError
    from outboxkit.testing import create_database, drop_database, dsn_with_dbname
    from tests.support.servers import unique_name

    admin = mariadb_server.url_for("mysql")
    name = unique_name("scratch")
    url = create_database(admin, name)
    assert url == dsn_with_dbname(admin, name) and url.endswith(f"/{name}")
    with pytest.raises(ConfigurationError, match="template"):
        create_database(admin, unique_name("scratch"), template=name)
    _migrate(url)
    _place(url, 1)
    import pymysql

    from outboxkit.backends.mariadb.sql import connect_args

    left = pymysql.connect(
        **connect_args(url)
    )  # a relay left behind, inside a transaction on the outbox
    try:
        with left.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("SELECT COUNT(*) FROM outbox")
        started = time.monotonic()
        drop_database(admin, name)
        assert time.monotonic() - started < 5
    finally:
        left.close()
    databases = [r[0] for r in mariadb_execute(admin, "SHOW DATABASES")]
    assert name not in databases
    drop_database(admin, name)  # gone already: nothing to do
