"""The MariaDB task claim's cost in rows the server reads (``Handler_read_*``): idle past a
large history of finished tasks, and at a large backlog.

MariaDB has no partial index: PostgreSQL's claim index (queue, priority, available_at, id)
WHERE the task is live becomes an index on ``live_queue``, a stored generated column that
is NULL once the task is finished (0001_tasks.sql). The naive claim on the plain columns
(its best index leads with status) sorts every due task of the backlog to take a batch;
the claim the store runs walks the index in its order and stops after the batch.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.tasks import MariaDBTaskStore
from outboxkit.backends.mariadb.tasks_sql import TaskStatements
from outboxkit.queue.tasks import TaskClaim
from tests.integration.test_mariadb_claim_plan import _connect, _global_reads, rows_read
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import own_database

N = 30_000
BATCH = 100
IDLE = 30
TABLE = "outboxkit_tasks"


@pytest.fixture
def plan_url(mariadb_server: MariaDB) -> Iterator[str]:
    with own_database(mariadb_server, "taskplan") as url:
        yield url


def _load(conn: Any, count: int, status: int, first: int) -> None:
    with conn.cursor() as cur:
        cur.execute(
            f"INSERT INTO {TABLE} (task_name, payload, status, available_at)"
            f" SELECT 'job', '{{}}', {status}, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR"
            f" FROM seq_{first}_to_{first + count - 1}"
        )


def _whole_claim(url: str, conn: Any) -> tuple[int, int]:
    """(tasks claimed, rows read server-wide) by one claim of the worker's store, released."""
    store = MariaDBTaskStore(url, TABLE, names=["job"])

    async def once() -> tuple[int, int]:
        try:
            what, options = TaskClaim("default"), {"owner": "w", "max_attempts": 9}
            warm = await store.claim_tasks(what, limit=1, lease=60, token=uuid.uuid4(), **options)
            if warm.claim is not None:
                await store.release(warm.claim)
            before = _global_reads(conn)
            token = uuid.uuid4()
            got = await store.claim_tasks(what, limit=BATCH, lease=60, token=token, **options)
            read = _global_reads(conn) - before
            if got.claim is not None:
                await store.release(got.claim)
            return (0 if got.claim is None else len(got.claim.ids)), read
        finally:
            await store.close()

    return asyncio.run(once())


def test_the_task_claim_reads_o_batch_rows_past_history_and_at_a_backlog(plan_url: str) -> None:
    migrate(plan_url, kind="tasks", table=TABLE)
    claim = TaskStatements(TABLE).claim_lock(1, 0, False, False)
    params = ("default", "job", BATCH)
    # the naive claim: PostgreSQL's predicate on the plain columns (no partial index here)
    naive = claim.replace(" FORCE INDEX (`outboxkit_tasks_claim`)", "").replace(
        "live_queue = %s", "queue = %s AND status IN (0, 1)"
    )
    conn = _connect(plan_url)
    try:
        _load(conn, N, 2, 1)  # done, kept (retention "keep")
        _load(conn, N, 3, N + 1)  # dead letters
        assert rows_read(conn, claim, params) == (0, 1)
        claimed, idle = _whole_claim(plan_url, conn)
        assert claimed == 0 and idle <= IDLE, idle
        _load(conn, N, 0, 2 * N + 1)
        returned, naive_read = rows_read(conn, naive, params)
        assert returned == BATCH and naive_read >= N, naive_read
        returned, read = rows_read(conn, claim, params)
        assert returned == BATCH and read <= BATCH + 1, read
        claimed, whole = _whole_claim(plan_url, conn)
        print(f"task claim of {BATCH} at {N} pending past {2 * N} finished: naive {naive_read}"
              f" rows, ours {read} (lock), {whole} (whole claim), idle {idle}")  # fmt: skip
        assert claimed == BATCH and whole <= 4 * BATCH, whole  # lock, lease, read back
    finally:
        conn.close()


def _load_key(conn: Any, count: int, status: int, first: int, key: str) -> None:
    with conn.cursor() as cur:
        cur.execute(
            f"INSERT INTO {TABLE} (task_name, payload, status, `key`)"
            f" SELECT 'job', '{{}}', {status}, %s FROM seq_{first}_to_{first + count - 1}",
            (key,),
        )


def test_a_keys_promotion_locks_its_next_tasks_not_the_whole_flood(plan_url: str) -> None:
    """concurrency_per_key=N: a promotion locks a key's first waiting tasks (FOR UPDATE, in
    id order) on the key index and stops at N of them; on the status index it walks (and
    locks) every earlier waiting task of the other keys first."""
    migrate(plan_url, kind="tasks", table=TABLE)
    sql = TaskStatements(TABLE)
    naive = sql.key_waiting_lock.replace("`outboxkit_tasks_key`", "`outboxkit_tasks_status`")
    conn = _connect(plan_url)
    try:
        _load_key(conn, N, 5, 1, "other")  # another key's, enqueued earlier
        _load_key(conn, 1, 1, N + 1, "flood")  # its running head
        _load_key(conn, N, 5, N + 2, "flood")  # waiting their turn
        returned, naive_read = rows_read(conn, naive, ("flood", 3))
        assert returned == 3 and naive_read >= N, naive_read
        returned, read = rows_read(conn, sql.key_waiting_lock, ("flood", 3))
        assert returned == 3 and read <= 4, read
        returned, room = rows_read(conn, sql.key_room, ("flood", 3, "flood", 3))
        assert room <= 8, room  # (two probes of the key index)
        print(f"promotion of 3 of a key behind {N} waiting: naive {naive_read} rows, ours"
              f" {read} (lock) + {room} (room)")  # fmt: skip
    finally:
        conn.close()
