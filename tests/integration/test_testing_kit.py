# ruff: noqa: F811 - the kit's fixtures are imported by name and requested by name
"""The testing kit (outboxkit.pytest) used as a user's test uses it, against the real table.

Its fixtures are imported here rather than enabled with ``-p``, so that this file runs in
the project's own session; examples/kit_orders runs them through ``-p outboxkit.pytest``.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

from outboxkit import Event, NotInTransactionError, Outbox
from outboxkit.errors import InvalidEventError
from outboxkit.publishers import from_url
from outboxkit.publishers.memory import MemoryBroker, MemoryPublisher
from outboxkit.pytest import (  # noqa: F401 - fixtures, found by name
    KitRelay,
    MemoryOutbox,
    OutboxEvents,
    PostgresDatabase,
    _outboxkit_server,
    outbox_events,
    outboxkit_broker,
    outboxkit_inbox,
    outboxkit_postgres,
    outboxkit_relay,
    outboxkit_tasks,
    received_event,
)

outbox = Outbox()


def order_event(order: int) -> Event:
    """The event the tests' order service writes for order ``order``."""
    return Event(
        topic="orders",
        event_type="order.placed",
        key=f"customer-{order}",
        payload={"order": order, "lines": [{"sku": "A", "qty": 2}]},
        aggregate_type="order",
        aggregate_id=str(order),
    )


def _place(dsn: str, order: int, *, fail: bool = False) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        outbox.put(conn, order_event(order))
        if fail:
            raise RuntimeError("the business change failed")


def test_committed_events_are_listed_and_a_rolled_back_one_is_not(
    outboxkit_postgres: PostgresDatabase, outbox_events: OutboxEvents
) -> None:
    _place(outboxkit_postgres.dsn, 1)
    with pytest.raises(RuntimeError):
        _place(outboxkit_postgres.dsn, 2, fail=True)
    event = outbox_events.assert_published(
        topic="orders", event_type="order.placed", key="customer-1", payload={"order": 1}
    )
    assert event.aggregate_id == "1"
    outbox_events.assert_not_published(payload={"order": 2})
    assert len(outbox_events) == 1
    assert [e.event_id for e in outbox_events.of_type("order.placed")] == [event.event_id]
    assert outbox_events.of_type("order.cancelled") == []


def test_a_failed_assertion_shows_what_the_outbox_holds(
    outboxkit_postgres: PostgresDatabase, outbox_events: OutboxEvents
) -> None:
    _place(outboxkit_postgres.dsn, 1)
    with pytest.raises(AssertionError) as failure:
        outbox_events.assert_published(event_type="order.placed", payload={"order": 9})
    text = str(failure.value)
    assert "found no event" in text
    assert "'payload': {'lines': [{'qty': 2, 'sku': 'A'}], 'order': 1}" in text
    with pytest.raises(AssertionError, match="expected no outbox event"):
        outbox_events.assert_not_published(key="customer-1")


def test_drain_publishes_the_exact_kafka_wire_message(
    outboxkit_postgres: PostgresDatabase, outboxkit_relay: KitRelay, outbox_events: OutboxEvents
) -> None:
    _place(outboxkit_postgres.dsn, 7)
    [message] = outboxkit_relay.drain()
    event = outbox_events.events[0]
    assert message.topic == "orders"
    assert message.key == "customer-7"
    assert message.headers["ce_id"] == str(event.event_id)
    assert message.headers["ce_type"] == "order.placed"
    assert message.headers["ce_source"] == "/outboxkit/order"
    assert message.headers["ce_specversion"] == "1.0"
    assert message.headers["idempotency-key"] == str(event.event_id)
    assert message.payload == event.payload
    [got] = outboxkit_relay.received()
    assert got.event_id == event.event_id
    assert got.json() == {"order": 7, "lines": [{"sku": "A", "qty": 2}]}
    assert outbox_events.rows()[0].status == "published"


def test_a_failure_on_cue_is_retried_then_published(
    outboxkit_postgres: PostgresDatabase, outboxkit_relay: KitRelay, outboxkit_broker: MemoryBroker
) -> None:
    _place(outboxkit_postgres.dsn, 1)
    outboxkit_broker.fail(2, topic="orders")
    [message] = outboxkit_relay.drain()
    assert message.attempt == 3
    assert len(outboxkit_broker.failures) == 2


def test_a_permanent_failure_is_dead_lettered(
    outboxkit_postgres: PostgresDatabase,
    outboxkit_relay: KitRelay,
    outboxkit_broker: MemoryBroker,
    outbox_events: OutboxEvents,
) -> None:
    _place(outboxkit_postgres.dsn, 1)
    outboxkit_broker.fail(permanent=True, error="schema registry said no")
    assert outboxkit_relay.drain() == []
    [row] = outbox_events.rows()
    assert row.status == "failed"
    assert "schema registry said no" in (row.last_error or "")


def test_retries_exhausted_are_dead_lettered(
    outboxkit_postgres: PostgresDatabase,
    outboxkit_relay: KitRelay,
    outboxkit_broker: MemoryBroker,
    outbox_events: OutboxEvents,
) -> None:
    _place(outboxkit_postgres.dsn, 1)
    outboxkit_broker.fail(outboxkit_relay.max_attempts)
    assert outboxkit_relay.drain() == []
    [row] = outbox_events.rows()
    assert (row.status, row.attempts) == ("failed", outboxkit_relay.max_attempts)


@pytest.mark.parametrize(("binding", "id_header"), [("nats", "ce-id"), ("webhook", "ce-id")])
def test_the_other_bindings_carry_percent_encoded_ce_headers(
    outboxkit_postgres: PostgresDatabase,
    outboxkit_broker: MemoryBroker,
    binding: str,
    id_header: str,
) -> None:
    relay = KitRelay(outboxkit_postgres.dsn, outboxkit_broker, binding=binding)  # type: ignore[arg-type]
    _place(outboxkit_postgres.dsn, 1)
    [message] = relay.drain()
    assert id_header in message.headers
    assert relay.received()[0].json()["order"] == 1


async def test_an_inbox_handler_applies_a_redelivered_event_once(
    outboxkit_postgres: PostgresDatabase, outboxkit_inbox
) -> None:
    with psycopg.connect(outboxkit_postgres.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE invoices (order_id int)")

    async def invoice(conn: psycopg.AsyncConnection, event) -> None:
        await conn.execute("INSERT INTO invoices VALUES (%s)", (event.json()["order"],))

    event = received_event(topic="orders", event_type="order.placed", payload={"order": 5})
    check = await outboxkit_inbox.deliver_twice(invoice, event)
    assert check.fresh == [True, False]
    with psycopg.connect(outboxkit_postgres.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM invoices").fetchone() == (1,)


async def test_deliver_twice_fails_for_a_handler_outside_the_inbox(
    outboxkit_postgres: PostgresDatabase, outboxkit_inbox
) -> None:
    outboxkit_inbox.consumer = "x"
    event = received_event(topic="t", event_type="e", payload={})
    await outboxkit_inbox.deliver(lambda conn, e: _noop(), event)
    with pytest.raises(AssertionError, match=r"ran: \[False, False\]"):
        await outboxkit_inbox.deliver_twice(lambda conn, e: _noop(), event)


async def _noop() -> None:
    return None


# --------------------------------------------------------------------------- no database


def test_memory_outbox_commits_on_a_clean_exit_and_discards_on_an_exception() -> None:
    memory = MemoryOutbox()
    event = Event(topic="orders", event_type="order.placed", payload={"order": 1})
    with memory.transaction() as tx:
        memory.put(tx, event)
    with pytest.raises(RuntimeError), memory.transaction() as tx:
        memory.put(tx, Event(topic="orders", event_type="order.placed", payload={"order": 2}))
        raise RuntimeError("rolled back")
    assert memory.committed == [event]
    [outbound] = memory.outbound()
    assert outbound.event_id == event.event_id


def test_memory_outbox_refuses_a_write_outside_its_transaction_as_the_real_one() -> None:
    memory = MemoryOutbox()
    event = Event(topic="orders", event_type="order.placed", payload={})
    tx = memory.transaction()
    with pytest.raises(NotInTransactionError, match="not open"):
        memory.put(tx, event)  # never entered
    with tx:
        pass
    with pytest.raises(NotInTransactionError, match="not open"):
        memory.put(tx, event)  # after the commit: a dual write in production
    with pytest.raises(NotInTransactionError, match="its own transaction"):
        memory.put(object(), event)
    with pytest.raises(NotInTransactionError), MemoryOutbox().transaction() as other:
        memory.put(other, event)
    with pytest.raises(InvalidEventError), memory.transaction() as tx:
        memory.put(tx, {"not": "an event"})  # type: ignore[arg-type]
    assert memory.committed == []


def test_memory_outbox_applies_the_outbox_limits() -> None:
    memory = MemoryOutbox(max_payload_bytes=10)
    with pytest.raises(InvalidEventError), memory.transaction() as tx:
        memory.put(tx, Event(topic="t", event_type="e", payload={"big": "x" * 100}))


def test_memory_urls_name_a_broker_shared_in_the_process() -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    publisher = from_url(f"memory://{name}?binding=nats")
    assert isinstance(publisher, MemoryPublisher)
    assert publisher.broker is MemoryBroker.named(name)
    assert publisher.binding == "nats"
    MemoryBroker.forget(name)


# --------------------------------------------------------------------------- task mode


def test_run_pending_runs_enqueued_tasks_with_the_workers_retries(
    outboxkit_postgres: PostgresDatabase, outboxkit_tasks
) -> None:
    from outboxkit.queue.tasks import TaskStatus
    from outboxkit.tasks import Tasks

    tasks = Tasks()
    ran: list[tuple[str, int]] = []

    @tasks.handler("report.generate", retry=[0], max_attempts=3)
    def generate(payload: dict) -> None:
        ran.append(("report", payload["n"]))
        if len([r for r in ran if r[0] == "report"]) == 1:
            raise RuntimeError("the first attempt fails")

    @tasks.handler("mail.send", retry=[0], max_attempts=2)
    def send(payload: dict) -> None:
        ran.append(("mail", payload["n"]))
        raise RuntimeError("smtp refused")

    outboxkit_tasks.run_pending(tasks)  # migrates the task table, runs nothing
    with psycopg.connect(outboxkit_postgres.dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "report.generate", {"n": 1})
        tasks.enqueue(conn, "mail.send", {"n": 2})
    with pytest.raises(RuntimeError), psycopg.connect(outboxkit_postgres.dsn) as conn:
        with conn.transaction():
            tasks.enqueue(conn, "report.generate", {"n": 3})
            raise RuntimeError("rolled back: the task is not enqueued")
    rows = {r["task_name"]: r for r in outboxkit_tasks.run_pending(tasks)}
    assert (rows["report.generate"]["status"], rows["report.generate"]["attempts"]) == (
        TaskStatus.DONE,
        2,
    )
    assert (rows["mail.send"]["status"], rows["mail.send"]["attempts"]) == (TaskStatus.FAILED, 2)
    assert "smtp refused" in rows["mail.send"]["last_error"]
    assert sorted(ran) == [("mail", 2), ("mail", 2), ("report", 1), ("report", 1)]


async def test_from_async_code_adrain_relays_and_drain_says_to_await_it(
    outboxkit_postgres: PostgresDatabase, outboxkit_relay: KitRelay
) -> None:
    _place(outboxkit_postgres.dsn, 3)
    with pytest.raises(RuntimeError, match="await adrain"):
        outboxkit_relay.drain()
    [message] = await outboxkit_relay.adrain()
    assert message.key == "customer-3"
