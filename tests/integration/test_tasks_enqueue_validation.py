"""Enqueue refuses what PostgreSQL would refuse, before anything is sent (docs/tasks.md).

Each of these reached the database and aborted the caller's transaction (a NUL in the
payload, max_attempts past int4, priority=True, a 100 KB key), or was stored changed
without a word (NaN as null). Each is now `InvalidTaskError` at the call, and the caller's
transaction goes on: its business row and a valid task commit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.tasks import InvalidTaskError, Tasks

tasks = Tasks()


@tasks.handler("v.job")
def job(payload: Any) -> None:
    pass


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int)")
    yield db_dsn


BAD: list[tuple[str, Any, dict[str, Any], str]] = [
    ("NUL in a string", {"note": "a\x00b"}, {}, "NUL"),
    ("NUL in a key of the payload", {"a\x00": 1}, {}, "NUL"),
    ("NaN", {"f": float("nan")}, {}, "NaN"),
    ("infinity in a list", {"f": [1.0, float("inf")]}, {}, "inf"),
    ("max_attempts past int4", None, {"max_attempts": 2**31}, "max_attempts"),
    ("max_attempts True", None, {"max_attempts": True}, "max_attempts"),
    ("priority True", None, {"priority": True}, "priority"),
    ("a 100 KB key", None, {"key": "k" * 100_000}, "key is 100000 bytes"),
    ("a 100 KB unique_key", None, {"unique_key": "u" * 100_000}, "unique_key is"),
    ("NUL in a key", None, {"key": "a\x00"}, "NUL"),
    ("NUL in a queue", None, {"queue": "q\x00"}, "NUL"),
]


@pytest.mark.parametrize(
    ("payload", "options", "says"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_a_value_postgresql_cannot_take_is_refused_and_the_transaction_goes_on(
    tasks_dsn: str, payload: Any, options: dict[str, Any], says: str
) -> None:
    with psycopg.connect(tasks_dsn) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES (1)")
            with pytest.raises(InvalidTaskError, match=says):
                tasks.enqueue(conn, "v.job", payload, **options)
            tasks.enqueue(conn, "v.job", {"fine": 1.5, "none": None})
        orders = conn.execute("SELECT count(*) FROM orders").fetchone()
        stored = conn.execute("SELECT payload FROM outboxkit_tasks").fetchall()
    assert orders == (1,)
    assert stored == [({"fine": 1.5, "none": None},)]


def test_values_at_the_limits_are_taken(tasks_dsn: str) -> None:
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "v.job", {"s": "\\u0000 is text here", "n": None})
        tasks.enqueue(conn, "v.job", None, max_attempts=2**31 - 1, priority=32767)
        tasks.enqueue(conn, "v.job", None, key="k" * 1024, unique_key="é" * 512)
        rows = conn.execute("SELECT count(*) FROM outboxkit_tasks").fetchone()
    assert rows == (3,)


def test_an_unregistered_name_says_which_process_lacks_the_handler(tasks_dsn: str) -> None:
    """The message sent a web process's reader to "the module the worker loads"."""
    import os

    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        with pytest.raises(InvalidTaskError, match=rf"in this process \(.*pid {os.getpid()}"):
            tasks.enqueue(conn, "receipt.send")
