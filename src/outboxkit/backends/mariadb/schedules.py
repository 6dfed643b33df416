"""Periodic tasks' slots on MariaDB/MySQL (the Schedules port of queue/tasks.py).

One run per (schedule, slot): the slot's row (``INSERT IGNORE`` on its primary key) and its
task are inserted in one transaction, the task only if the slot's insert won, so however
many workers try, exactly one enqueues it (PostgreSQL's ENQUEUE_PERIODIC, in two
statements). Times are the database's clock, UTC.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from outboxkit.backends.mariadb.session import MariaDBSession, micros
from outboxkit.backends.mariadb.tasks import utc
from outboxkit.backends.mariadb.tasks_sql import TaskStatements


def _naive(value: dt.datetime) -> dt.datetime:
    return value.astimezone(dt.UTC).replace(tzinfo=None)


class MariaDBSchedules(MariaDBSession):
    """The schedules table, as the periodic side task uses it (one connection, autocommit)."""

    what = "the worker"

    def __init__(self, dsn: str, table: str) -> None:
        super().__init__(dsn, roles=("periodic",))
        self.sql = TaskStatements(table)

    async def _one(self, statement: str, params: tuple[Any, ...] = ()) -> Any:
        async def run(cur: Any) -> Any:
            await cur.execute(statement, params)
            return await cur.fetchone()

        return await self._run("periodic", run)

    async def now(self) -> dt.datetime:
        (now,) = await self._one(self.sql.database_now)
        return utc(now)  # type: ignore[return-value]

    async def last_slot(self, schedule: str) -> tuple[dt.datetime | None, dt.datetime]:
        last, now = await self._one(self.sql.last_slot, (schedule,))
        return utc(last), utc(now)  # type: ignore[return-value]

    async def enqueue(
        self, schedule: str, slot: dt.datetime, name: str, queue: str, payload: str, priority: int
    ) -> int | None:
        sq, at = self.sql, _naive(slot)

        async def run(cur: Any) -> int | None:
            await cur.execute("BEGIN")
            await cur.execute(sq.insert_slot, (schedule, at))
            if not cur.rowcount:
                await cur.execute("COMMIT")
                return None
            await cur.execute(sq.enqueue_periodic, (name, queue, payload, priority))
            (task_id,) = await cur.fetchone()
            await cur.execute(sq.set_slot_task, (task_id, schedule, at))
            await cur.execute("COMMIT")
            return int(task_id)

        return await self._run("periodic", run)  # type: ignore[no-any-return]

    async def prune(self, keep: float, limit: int) -> int:
        async def run(cur: Any) -> int:
            await cur.execute(self.sql.prune_slots, (micros(keep), limit))
            return int(cur.rowcount)

        return await self._run("periodic", run)  # type: ignore[no-any-return]

    async def close(self) -> None:
        self._close_connections()
