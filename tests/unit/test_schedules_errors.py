"""PostgreSQL's schedules raise the port's StoreError, as MariaDB's do.

tasks/periodic.py caught ``psycopg.Error`` besides StoreError because PostgreSQL's
schedules let the driver's errors out: the task layer had to know the driver. Now the
periodic loop catches the port's error only, so a driver error escaping would end it.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from outboxkit.backends.postgres.tasks_pg import PgSchedules
from outboxkit.queue.store import StoreError

# Nothing listens on port 1: the connection is refused at once.
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=2"


def test_a_refused_connection_is_a_store_error_with_psycopg_s_as_its_cause() -> None:
    schedules = PgSchedules(UNREACHABLE, "outboxkit_tasks", pooler="none")

    async def calls() -> list[BaseException]:
        raised: list[BaseException] = []
        for call in (
            schedules.now(),
            schedules.last_slot("nightly"),
            schedules.prune(60.0, 10),
        ):
            with pytest.raises(StoreError) as info:
                await call
            raised.append(info.value)
        await schedules.close()
        return raised

    for exc in asyncio.run(calls()):
        assert isinstance(exc, StoreError) and isinstance(exc.cause, psycopg.OperationalError)
