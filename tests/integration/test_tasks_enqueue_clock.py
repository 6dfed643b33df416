"""`enqueue(delay=...)` is due by the database's clock, as leases and periodic tasks are.

An application host whose clock runs an hour ahead once made `delay=2` due an hour and two
seconds later (the delay was added to the host's `now`). The insert now adds the delay to
the database's `now()`: within the enqueuing transaction `available_at - now()` is the
delay exactly, whatever the host's clock says.
"""

from __future__ import annotations

import datetime as dt
import types
from collections.abc import Iterator

import psycopg
import pytest

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.tasks import Tasks, registry

tasks = Tasks()


@tasks.handler("clock.job")
def job(payload: None) -> None:
    pass


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    yield db_dsn


@pytest.fixture
def host_clock_an_hour_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library's view of the host's clock, an hour fast."""

    class Fast(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> Fast:  # type: ignore[override]
            return super().now(tz) + dt.timedelta(hours=1)  # type: ignore[return-value]

    shim = types.SimpleNamespace(**{n: getattr(dt, n) for n in dir(dt) if not n.startswith("_")})
    shim.datetime = Fast
    monkeypatch.setattr(registry, "dt", shim)


def _due_in(conn: psycopg.Connection[object]) -> dt.timedelta:
    row = conn.execute("SELECT max(available_at) - now() FROM outboxkit_tasks").fetchone()
    assert row is not None
    value = row[0]
    assert isinstance(value, dt.timedelta)
    return value


@pytest.mark.usefixtures("host_clock_an_hour_ahead")
def test_a_delay_is_added_to_the_database_clock_not_the_hosts(tasks_dsn: str) -> None:
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "clock.job", delay=2)
        assert _due_in(conn) == dt.timedelta(seconds=2)
        tasks.enqueue(conn, "clock.job", delay=dt.timedelta(minutes=5))
        assert _due_in(conn) == dt.timedelta(minutes=5)
    # the same through the COMMIT pipeline (tasks.transaction(): binary parameters)
    with psycopg.connect(tasks_dsn) as conn:
        conn.execute("DELETE FROM outboxkit_tasks")
        conn.commit()
        with tasks.transaction(conn) as tx:
            tx.enqueue("clock.job", delay=30)
        row = conn.execute("SELECT available_at - created_at FROM outboxkit_tasks").fetchone()
        assert row is not None and dt.timedelta(seconds=29) < row[0] < dt.timedelta(seconds=31)


@pytest.mark.usefixtures("host_clock_an_hour_ahead")
def test_no_delay_and_run_at_keep_their_meaning(tasks_dsn: str) -> None:
    at = dt.datetime(2031, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    with psycopg.connect(tasks_dsn) as conn, conn.transaction():
        tasks.enqueue(conn, "clock.job")
        assert _due_in(conn) == dt.timedelta(0)
        tasks.enqueue(conn, "clock.job", run_at=at)
        row = conn.execute("SELECT max(available_at) FROM outboxkit_tasks").fetchone()
        assert row is not None and row[0] == at
