"""drivers/psycopg2_adapter.py on plain psycopg2 connections (no framework)."""

from __future__ import annotations

import uuid

import psycopg2
import psycopg2.extras
import pytest

from outboxkit import Event, Inbox, Outbox
from outboxkit.errors import NotInTransactionError
from tests.support.relaying import rows


def _event(key: str) -> Event:
    return Event(topic="orders", event_type="order.placed", key=key, payload={"k": key})


def test_writes_commit_and_roll_back_with_the_psycopg2_transaction(db_dsn: str) -> None:
    outbox = Outbox()
    conn = psycopg2.connect(db_dsn, connection_factory=psycopg2.extras.RealDictConnection)
    try:
        outbox.put(conn, _event("a"))  # type: ignore[arg-type]
        outbox.put_many(conn, [_event("b"), _event("c")])  # type: ignore[arg-type]
        conn.commit()
        outbox.put(conn, _event("gone"))  # type: ignore[arg-type]
        conn.rollback()
    finally:
        conn.close()
    assert [r["key"] for r in rows(db_dsn)] == ["a", "b", "c"]


def test_autocommit_a_failed_transaction_and_a_closed_connection_are_refused(
    db_dsn: str,
) -> None:
    outbox = Outbox()
    conn = psycopg2.connect(db_dsn)
    try:
        conn.autocommit = True
        with pytest.raises(NotInTransactionError, match="autocommit"):
            outbox.put(conn, _event("a"))  # type: ignore[arg-type]
        with conn.cursor() as cur:
            cur.execute("BEGIN")
            outbox.put(conn, _event("in-begin"))  # type: ignore[arg-type]
            with pytest.raises(psycopg2.Error):
                cur.execute("SELECT 1/0")
        with pytest.raises(NotInTransactionError, match="already failed"):
            outbox.put(conn, _event("b"))  # type: ignore[arg-type]
        with pytest.raises(NotInTransactionError, match="already failed"):
            Inbox().mark(conn, "billing", uuid.uuid4())  # type: ignore[arg-type]
    finally:
        conn.close()
    with pytest.raises(NotInTransactionError, match="closed"):
        outbox.put(conn, _event("c"))  # type: ignore[arg-type]
    assert rows(db_dsn) == []
