"""The order service's tests, written only with outboxkit's testing kit."""

from __future__ import annotations

import asyncio

import orders
import psycopg
import pytest

from outboxkit import NotInTransactionError
from outboxkit.pytest import MemoryOutbox, received_event


@pytest.fixture
def conn(outboxkit_postgres):
    with outboxkit_postgres.connect() as conn:
        orders.create_schema(conn)
        yield conn


def test_placing_an_order_commits_its_event(conn, outbox_events):
    order_id = orders.place_order(conn, "alice", 1250)
    outbox_events.assert_published(
        topic="orders",
        event_type="order.placed",
        key="alice",
        payload={"order_id": order_id, "total_cents": 1250},
    )


def test_a_refused_order_leaves_no_event(conn, outbox_events):
    with pytest.raises(ValueError, match="must be positive"):
        orders.place_order(conn, "bob", 0)
    outbox_events.assert_not_published(event_type="order.placed")
    assert conn.execute("SELECT count(*) FROM orders").fetchone() == (0,)


def test_the_kafka_record_carries_the_cloudevents_attributes(conn, outboxkit_relay):
    order_id = orders.place_order(conn, "carol", 990)
    [record] = outboxkit_relay.drain()
    assert record.topic == "orders"
    assert record.key == "carol"
    assert record.headers["ce_type"] == "order.placed"
    assert record.headers["ce_source"] == "/outboxkit/order"
    assert record.headers["ce_subject"] == str(order_id)
    assert record.headers["content-type"] == "application/json"


def test_a_broker_failure_is_retried(conn, outboxkit_relay, outboxkit_broker):
    orders.place_order(conn, "dave", 500)
    outboxkit_broker.fail(1)  # the next publish is refused, as a broker timing out would
    [record] = outboxkit_relay.drain()
    assert record.attempt == 2


class FlakyMailer:
    def __init__(self, failures):
        self.failures, self.sent = failures, []

    def send(self, to, text):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("smtp timed out")
        self.sent.append(to)


def test_the_receipt_task_retries_a_failed_mail(conn, outboxkit_tasks, monkeypatch):
    mailer = FlakyMailer(failures=1)
    monkeypatch.setattr(orders, "mailer", mailer)
    orders.place_order(conn, "frank", 300)
    [task] = outboxkit_tasks.run_pending(orders.tasks)
    assert (task["status"].name, task["attempts"]) == ("DONE", 2)
    assert mailer.sent == ["frank"]


def test_billing_invoices_a_redelivered_order_once(conn, outboxkit_inbox):
    event = received_event(
        topic="orders", event_type="order.placed", payload={"order_id": 1, "total_cents": 700}
    )
    asyncio.run(outboxkit_inbox.deliver_twice(orders.invoice, event))
    assert conn.execute("SELECT count(*) FROM invoices").fetchone() == (1,)


# No database at all: the event written through a MemoryOutbox.


def test_announce_without_a_database():
    memory = MemoryOutbox()
    with memory.transaction() as tx:
        orders.announce(memory, tx, 7, "erin", 100)
    [event] = memory.committed
    assert event.event_type == "order.placed"


def test_announce_outside_a_transaction_is_refused_as_in_production():
    memory = MemoryOutbox()
    with pytest.raises(NotInTransactionError):
        orders.announce(memory, memory.transaction(), 7, "erin", 100)


def test_the_real_outbox_refuses_an_autocommit_connection(outboxkit_postgres):
    with (
        psycopg.connect(outboxkit_postgres.dsn, autocommit=True) as conn,
        pytest.raises(NotInTransactionError),
    ):
        orders.announce(orders.outbox, conn, 7, "erin", 100)
