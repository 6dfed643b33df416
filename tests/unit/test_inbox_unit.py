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
