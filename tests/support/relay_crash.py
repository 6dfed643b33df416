"""Catch a relay between publishing a batch and settling it: the worst moment to kill it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg

_STALL_FUNCTION = """
CREATE FUNCTION outboxkit_test_stall() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(600); RETURN OLD; END $$
"""


@contextlib.contextmanager
def settles_stalled(dsn: str) -> Iterator[None]:
    """While inside, a relay's settle (the DELETE of published rows) hangs in the database.

    So a relay killed inside this block has published its batch and settled nothing: the
    worst case for duplicates. On exit the stalled statements are terminated (their
    transactions roll back; the rows keep their leases) and the trigger is dropped.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_STALL_FUNCTION)
        conn.execute(
            "CREATE TRIGGER outboxkit_test_stall BEFORE DELETE ON outbox"
            " FOR EACH ROW EXECUTE FUNCTION outboxkit_test_stall()"
        )
    try:
        yield
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND query LIKE '%DELETE%'"
            )
            conn.execute("DROP TRIGGER outboxkit_test_stall ON outbox")
            conn.execute("DROP FUNCTION outboxkit_test_stall()")


def stalled_settles(dsn: str) -> int:
    """How many settle statements are hanging in the stall trigger right now."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND query LIKE '%DELETE%' AND state = 'active'"
        ).fetchone()
        assert row is not None
        return int(row[0])
