"""psycopg's private state that outboxkit relies on is still there, with the same shape.

``outboxkit.drivers.psycopg_private`` is the only module reading it. When a psycopg
release renames any of it, this test fails loudly, before users hit a commit that
fails; ``pyproject.toml`` caps psycopg until this test has passed on a newer release.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import psycopg

from outboxkit import Outbox
from outboxkit.drivers import psycopg_private as private
from tests.integration.test_write import _event


def test_the_private_attributes_outboxkit_reads_exist(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        assert private.open_transaction_blocks(conn) == 0
        with conn.transaction():
            assert private.open_transaction_blocks(conn) == 1
            assert conn._num_transactions == 1
        assert conn._pipeline is None
        with conn.pipeline():
            assert private.in_pipeline(conn)
        assert private.begin_command(conn) == b"BEGIN"
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        conn.read_only = True
        assert private.begin_command(conn) == b"BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY"
        assert isinstance(conn.pgconn._encoding, str)
        assert private.encoding(conn.pgconn) == "utf-8"
        manager = conn._prepared
        assert isinstance(manager._names, OrderedDict)
        assert isinstance(manager._to_flush, deque)
        assert callable(manager.maintain_gen)


def test_psycopgs_cache_keys_have_the_shape_outboxkit_registers(db_dsn: str) -> None:
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("SELECT %b::int", (1,), prepare=True)
        ((key, name),) = conn._prepared._names.items()
        query, types = key
        assert isinstance(query, bytes)
        assert isinstance(types, tuple)
        assert all(isinstance(t, int) for t in types)
        assert name.startswith(b"_pg3_")
        # outboxkit's statement joins the same cache and is forgotten with psycopg's own
        with Outbox(notify=False).transaction(conn) as tx:
            tx.put(_event())
        assert any(n.startswith(b"outboxkit_put_") for n in conn._prepared._names.values())
        conn.execute("BEGIN")
        conn.rollback()  # psycopg: DEALLOCATE ALL, and a cleared cache
        assert not conn._prepared._names
        names = [r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements")]
        assert not any(n.startswith("outboxkit_put_") for n in names)
