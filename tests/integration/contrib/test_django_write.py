"""outboxkit.contrib.django's outbox and inbox in transaction.atomic(), on a real PostgreSQL."""

from __future__ import annotations

import uuid

import pytest

from outboxkit import Event
from outboxkit.errors import NotInTransactionError
from tests.support.relaying import count, rows


def _event(n: int = 0) -> Event:
    return Event(topic="orders", event_type="order.placed", key=f"o{n}", payload={"n": n})


def test_put_in_atomic_commits_with_the_block(django_dsn: str) -> None:
    from django.db import connection, transaction

    from outboxkit.contrib.django import outbox

    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("CREATE TABLE orders (id int)")
            cur.execute("INSERT INTO orders VALUES (1)")
        outbox.put(_event(1))
        outbox.put_many([_event(2), _event(3)])
        assert count(django_dsn) == 0  # not visible before the COMMIT
    assert [r["key"] for r in rows(django_dsn)] == ["o1", "o2", "o3"]


def test_an_exception_in_atomic_rolls_the_event_back_with_the_change(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import outbox

    with pytest.raises(RuntimeError), transaction.atomic():
        outbox.put(_event())
        raise RuntimeError("business rule failed")
    assert count(django_dsn) == 0


def test_a_nested_atomic_rolled_back_takes_its_events_with_it(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import outbox

    with transaction.atomic():
        outbox.put(_event(1))
        with pytest.raises(RuntimeError), transaction.atomic():
            outbox.put(_event(2))
            raise RuntimeError("inner step failed")
    assert [r["key"] for r in rows(django_dsn)] == ["o1"]


def test_put_outside_atomic_is_refused_and_writes_nothing(django_dsn: str) -> None:
    from outboxkit.contrib.django import inbox, outbox

    with pytest.raises(NotInTransactionError, match=r"transaction\.atomic\(\)"):
        outbox.put(_event())
    with pytest.raises(NotInTransactionError, match="autocommit"):
        outbox.put_many([_event()])
    with pytest.raises(NotInTransactionError):
        inbox.mark("billing", uuid.uuid4())
    assert count(django_dsn) == 0


def test_using_writes_in_that_databases_atomic_block_only(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import outbox

    with transaction.atomic(using="other"):
        outbox.put(_event(1), using="other")
        # the default connection has no atomic block open: refused, not written alone
        with pytest.raises(NotInTransactionError, match="'default'"):
            outbox.put(_event(2))
    with pytest.raises(RuntimeError), transaction.atomic(using="other"):
        outbox.put(_event(3), using="other")
        raise RuntimeError("rolled back")
    assert [r["key"] for r in rows(django_dsn)] == ["o1"]


def test_atomic_requests_is_an_atomic_block(django_dsn: str) -> None:
    from django.test import Client

    client = Client(raise_request_exception=False)
    assert client.get("/orders/").status_code == 200
    assert count(django_dsn) == 1
    # the view raised after its write: ATOMIC_REQUESTS rolled the event back with it
    assert client.get("/orders/?fail=1").status_code == 500
    assert count(django_dsn) == 1
    # a view taken out of ATOMIC_REQUESTS runs in autocommit: the write is refused
    assert client.get("/orders-autocommit/").status_code == 500
    assert count(django_dsn) == 1


def test_inbox_applies_an_event_once_per_consumer(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import inbox

    event_id = uuid.uuid4()
    applied = []
    for _ in range(2):
        with transaction.atomic(), inbox.handle("billing", event_id) as fresh:
            if fresh:
                applied.append(event_id)
    with pytest.raises(RuntimeError), transaction.atomic():
        with inbox.handle("shipping", event_id) as fresh:
            assert fresh
            raise RuntimeError("the effect failed: the record rolls back with it")
    with transaction.atomic():
        assert inbox.seen("billing", event_id)
        assert not inbox.seen("shipping", event_id)
    assert applied == [event_id]
