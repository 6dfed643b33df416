"""`outboxkit cdc setup | status | drop` and the slot checks, on real PostgreSQL servers."""

from __future__ import annotations

import psycopg


def test_logical_server_has_wal_level_logical(logical_db_dsn: str) -> None:
    with psycopg.connect(logical_db_dsn, autocommit=True) as conn:
        row = conn.execute("SHOW wal_level").fetchone()
        assert row == ("logical",)
        conn.execute("SELECT pg_create_logical_replication_slot('probe', 'pgoutput')")
