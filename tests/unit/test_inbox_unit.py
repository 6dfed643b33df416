"""The inbox's checks that need no database: table names, drivers it cannot use."""

from __future__ import annotations

import uuid

import pytest

from outboxkit import ConfigurationError, Inbox, NotInTransactionError
from outboxkit.backends.postgres.inbox_sql import InboxStatements


def test_table_names_are_validated_and_quoted() -> None:
    with pytest.raises(ConfigurationError, match="invalid"):
        Inbox('x"; DROP TABLE users; --')
    stmts = InboxStatements("billing.processed_events")
    assert '"billing"."processed_events"' in stmts.mark
    assert "ON CONFLICT DO NOTHING" in stmts.mark
    assert stmts.ddl().startswith('CREATE TABLE IF NOT EXISTS "billing"."processed_events"')


def test_objects_that_are_not_connections_are_refused() -> None:
    inbox = Inbox()
    with pytest.raises(TypeError, match="expected psycopg.Connection"):
        inbox.mark(object(), "billing", uuid.uuid4())


class FakePool:  # looks like a pool by name, as psycopg_pool.ConnectionPool does
    pass


def test_a_pool_is_refused_with_what_to_do() -> None:
    with pytest.raises(NotInTransactionError, match="take a connection"):
        Inbox().mark(FakePool(), "billing", uuid.uuid4())


async def test_async_api_refuses_sync_objects() -> None:
    with pytest.raises(TypeError, match="expected psycopg.AsyncConnection"):
        await Inbox().amark(object(), "billing", uuid.uuid4())


def test_each_backend_hands_the_inbox_its_statements_and_its_consumer_check() -> None:
    """The Inbox asks the connection's Backend (no database test of its own): MariaDB's
    record is an INSERT IGNORE whose VARCHAR(255) would cut a longer name, so its backend
    refuses one; PostgreSQL's (text) keeps any."""
    from outboxkit.backends import backend_for

    maria = backend_for("mysql://").inbox_sql("processed_events")
    assert maria.mark.startswith("INSERT IGNORE") and maria.mark == maria.mark_dollar
    with pytest.raises(ValueError, match="at most 255"):
        maria.check_consumer("c" * 256)
    maria.check_consumer("c" * 255)
    pg = backend_for("postgresql://").inbox_sql("processed_events")
    assert "$1" in pg.mark_dollar and "%s" in pg.mark
    pg.check_consumer("c" * 1000)
