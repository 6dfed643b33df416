"""On psycopg 3 the events ride with the atomic block's COMMIT: nothing is sent before it,
savepoints and rollbacks drop what they should, a failed INSERT fails the COMMIT."""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit import Event
from outboxkit.errors import InvalidEventError, TableNotFoundError
from tests.support.relaying import rows


def _event(key: str, **kw: Any) -> Event:
    return Event(topic="orders", event_type="order.placed", key=key, payload={"k": key}, **kw)


def _in_table() -> int:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM outbox")
        return int(cur.fetchone()[0])


def test_nothing_is_sent_before_the_commit(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import outbox

    with transaction.atomic():
        outbox.put(_event("a"))
        outbox.put_many([_event("b"), _event("c")])
        assert _in_table() == 0  # same connection: no INSERT went out
    assert [r["key"] for r in rows(django_dsn)] == ["a", "b", "c"]


def test_write_with_commit_off_inserts_at_each_put(django_dsn: str) -> None:
    from django.db import transaction
    from django.test import override_settings

    from outboxkit.contrib.django import outbox

    with override_settings(OUTBOXKIT={"WRITE_WITH_COMMIT": False}), transaction.atomic():
        outbox.put(_event("a"))
        assert _in_table() == 1


def test_savepoints_rolled_back_drop_their_events_only(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import outbox

    with transaction.atomic():
        outbox.put(_event("kept-1"))
        with transaction.atomic():
            outbox.put(_event("kept-2"))  # its savepoint is released, not rolled back
        sid = transaction.savepoint()
        outbox.put(_event("dropped-1"))
        with transaction.atomic():
            outbox.put(_event("dropped-2"))
        transaction.savepoint_rollback(sid)
        with pytest.raises(RuntimeError), transaction.atomic():
            outbox.put(_event("dropped-3"))
            raise RuntimeError("inner block failed")
        outbox.put(_event("kept-3"))
    assert [r["key"] for r in rows(django_dsn)] == ["kept-1", "kept-2", "kept-3"]


def test_a_rolled_back_transaction_leaves_nothing_for_the_next_one(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import outbox

    with pytest.raises(RuntimeError), transaction.atomic():
        outbox.put(_event("gone"))
        raise RuntimeError("rolled back")
    with transaction.atomic():
        outbox.put(_event("next"))
    assert [r["key"] for r in rows(django_dsn)] == ["next"]


def test_a_bad_event_fails_at_put_and_the_block_goes_on(django_dsn: str) -> None:
    from django.db import transaction
    from django.test import override_settings

    from outboxkit.contrib.django import outbox

    with override_settings(OUTBOXKIT={"MAX_PAYLOAD_BYTES": 64}), transaction.atomic():
        with pytest.raises(InvalidEventError, match="payload"):
            outbox.put(Event(topic="orders", event_type="big", payload=b"x" * 65))
        with pytest.raises(InvalidEventError):
            outbox.put_many(["not an event"])  # type: ignore[list-item]
        outbox.put(_event("fine"))
    assert [r["key"] for r in rows(django_dsn)] == ["fine"]


def test_a_failing_insert_fails_the_commit_and_rolls_back_the_change(django_dsn: str) -> None:
    from django.db import connection, transaction
    from django.test import override_settings

    from outboxkit.contrib.django import outbox

    hooks: list[str] = []
    with connection.cursor() as cur:
        cur.execute("CREATE TABLE orders (id int)")
    with override_settings(OUTBOXKIT={"TABLE": "missing"}):
        with pytest.raises(TableNotFoundError, match="missing"), transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("INSERT INTO orders VALUES (1)")
            outbox.put(_event("lost"))
            transaction.on_commit(lambda: hooks.append("ran"))
    with transaction.atomic():  # the connection is usable, no hook left over to run
        outbox.put(_event("after"))
        with connection.cursor() as cur:
            cur.execute("SELECT count(*) FROM orders")
            assert cur.fetchone()[0] == 0
    assert hooks == []
    assert [r["key"] for r in rows(django_dsn)] == ["after"]


def test_on_commit_hooks_run_after_the_events_are_committed(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import outbox

    seen: list[list[str]] = []
    with transaction.atomic():
        outbox.put(_event("a"))
        transaction.on_commit(lambda: seen.append([r["key"] for r in rows(django_dsn)]))
    assert seen == [["a"]]


def test_inside_djangos_testcase_transaction_each_put_inserts_at_once(django_dsn: str) -> None:
    from django.db import transaction

    from outboxkit.contrib.django import outbox

    test_case = transaction.atomic()
    test_case._from_testcase = True  # what django.test.TestCase marks its atomic blocks with
    with test_case:
        with transaction.atomic():  # the code under test: never committed in a TestCase
            outbox.put(_event("seen"))
        assert _in_table() == 1
        transaction.set_rollback(True)
    assert rows(django_dsn) == []
