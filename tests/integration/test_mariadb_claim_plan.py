"""The MariaDB claim's cost, in rows the server reads (``Handler_read_*``), at an empty table,
past a large history of published and dead-lettered rows, and at a large backlog.

MariaDB has no NOTIFY: relays poll, so every idle poll and every claim under a backlog must
read O(batch) rows, never the table. Each test shows a naive statement reading O(n) first,
then the relay's own statements (the strings the store runs) reading O(batch). Rows are
loaded server-side (``INSERT … SELECT`` from ``seq_1_to_N``) to stay within seconds.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.ordered_sql import OrderedStatements, expand, scan_query
from outboxkit.backends.mariadb.queue import MariaDBQueueStore
from outboxkit.backends.mariadb.sql import FAILED, PENDING, PUBLISHED, Statements, connect_args
from outboxkit.queue.store import HeadsOnly
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import own_database

#: Rows of each kind loaded: history (published + dead) and backlog (pending).
N = 30_000
BATCH = 100
#: What an idle claim reads server-wide (index probes, the store's session statements).
IDLE = 20
KEYS = 400


@pytest.fixture
def plan_url(mariadb_server: MariaDB) -> Iterator[str]:
    with own_database(mariadb_server, "plan") as url:
        yield url


def _connect(url: str) -> Any:
    conn = pymysql.connect(**connect_args(url), autocommit=True)
    with conn.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")  # as the store
    return conn


def _load(conn: Any, count: int, status: int, first: int) -> None:
    """``count`` rows in ``status`` (keyed k0…k399, due an hour ago), in one statement."""
    published = "UTC_TIMESTAMP(6)" if status == PUBLISHED else "NULL"
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO outbox (event_id, topic, `key`, event_type, payload, headers, status,"
            " available_at, published_at)"
            " SELECT CONCAT('00000000-0000-7000-8000-', LPAD(seq, 12, '0')), 't',"
            f" CONCAT('k', seq % {KEYS}), 'e', '', '{{}}', {status},"
            f" UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, {published}"
            f" FROM seq_{first}_to_{first + count - 1}"
        )


def rows_read(conn: Any, statement: str, params: Any = ()) -> tuple[int, int]:
    """(rows returned, rows the server read) for ``statement`` run in a transaction rolled
    back after (its locks taken and let go). Run twice: the first may load statistics."""
    with conn.cursor() as cur:
        for _ in range(2):
            cur.execute("FLUSH STATUS")
            cur.execute("BEGIN")
            cur.execute(statement, params)
            returned = len(cur.fetchall())
            cur.execute("ROLLBACK")
            cur.execute("SHOW SESSION STATUS LIKE 'Handler_read%'")
            read = sum(int(v) for _, v in cur.fetchall())
    return returned, read


def _global_reads(conn: Any) -> int:
    with conn.cursor() as cur:
        cur.execute("SHOW GLOBAL STATUS LIKE 'Handler_read%'")
        return sum(int(v) for _, v in cur.fetchall())


def _make(*columns: Any) -> tuple[Any, ...]:
    return columns


def _whole_claim(url: str, conn: Any, *, ordered: bool = False) -> tuple[int, int]:
    """(rows claimed, rows read server-wide) by one claim of the store the relay runs, its
    leases let go after (the private server runs nothing else meanwhile)."""
    store: MariaDBQueueStore[Any] = MariaDBQueueStore(url, "outbox", _make, ordered=ordered)
    policy = HeadsOnly(margin=0.0, draining=(), block=True) if ordered else None

    async def once() -> tuple[int, int]:
        try:
            await store.claim(  # warm: statistics, the partition count
                limit=1, lease=0.0, token=uuid.uuid4(), owner="r", max_attempts=9, policy=policy
            )
            before = _global_reads(conn)
            claim = await store.claim(
                limit=BATCH, lease=60, token=uuid.uuid4(), owner="r", max_attempts=9, policy=policy
            )
            read = _global_reads(conn) - before
            if claim is not None:
                await store.release(claim)
            return (0 if claim is None else len(claim.ids)), read
        finally:
            await store.close()

    return asyncio.run(once())


def test_the_claim_reads_o_batch_rows_empty_past_history_and_at_a_backlog(plan_url: str) -> None:
    migrate(plan_url)
    claim = Statements().claim_lock
    # the naive claim: PostgreSQL's order (by id) on MariaDB's index sorts every due row
    naive = claim.replace(" FORCE INDEX (`outbox_pending`)", "").replace(
        "ORDER BY available_at, id", "ORDER BY id"
    )
    conn = _connect(plan_url)
    try:
        # an empty table, then past a history of published and dead rows: one index probe
        assert rows_read(conn, claim, (BATCH,)) == (0, 1)
        assert _whole_claim(plan_url, conn)[1] <= IDLE
        _load(conn, N, PUBLISHED, 1)
        _load(conn, N, FAILED, N + 1)
        assert rows_read(conn, claim, (BATCH,)) == (0, 1)
        assert _whole_claim(plan_url, conn)[1] <= IDLE
        _load(conn, N, PENDING, 2 * N + 1)
        returned, naive_read = rows_read(conn, naive, (BATCH,))
        assert returned == BATCH and naive_read >= N, naive_read
        returned, read = rows_read(conn, claim, (BATCH,))
        assert returned == BATCH and read <= BATCH + 1, read
        claimed, read = _whole_claim(plan_url, conn)
        print(f"claim of {BATCH} at {N} pending: naive {naive_read}, ours {read} (whole claim)")
        assert claimed == BATCH and read <= 4 * BATCH, read  # lock, lease, read back
        with conn.cursor() as cur:
            cur.execute("EXPLAIN FORMAT=JSON " + claim, (BATCH,))
            plan = cur.fetchone()[0]
        assert '"key": "outbox_pending"' in plan and "filesort" not in plan, plan
    finally:
        conn.close()


def test_the_ordered_claim_reads_o_batch_rows_at_a_backlog(plan_url: str) -> None:
    migrate(plan_url, kind="ordered", partitions=64)
    o = OrderedStatements()
    scan = 4 * BATCH  # SCAN_FACTOR x the batch
    conn = _connect(plan_url)
    try:
        every, few = list(range(64)), [5]
        for held in (every, few):  # empty table
            assert rows_read(conn, *_scan(o, held))[1] <= 2
        _load(conn, N, PUBLISHED, 1)
        _load(conn, N, PENDING, N + 1)
        # the naive scan (schema version 1's): the held partitions' rows, sorted by id
        naive = expand(
            "SELECT id, `key` FROM `outbox` FORCE INDEX (`outbox_ordered`) WHERE status = 0"
            " AND available_at <= UTC_TIMESTAMP(6) AND `partition` {parts} ORDER BY id LIMIT %s",
            parts=64,
        )
        returned, read = rows_read(conn, naive, (*every, scan))
        print(f"ordered scan of {scan} at {N} pending: naive {read}")
        assert returned == scan and read >= N, read
        # ours: a walk by id holding many partitions, one branch each holding few (the
        # union's rows are read again from its temporary table: 3 reads a row)
        for held, bound in ((every, scan + 64), (few, 3 * scan + 2)):
            returned, read = rows_read(conn, *_scan(o, held))
            print(f"ordered scan holding {len(held)} of 64: ours {read}")
            assert returned == scan and read <= bound, (len(held), read)
        # the blockers of the scanned keys: their unsettled rows, not their history
        with conn.cursor() as cur:
            cur.execute(*_scan(o, every))
            scanned = list(cur.fetchall())
        keys = sorted({k for _, k in scanned})
        last = max(i for i, _ in scanned)
        blockers = expand(o.blockers, keys=len(keys), ids=1)
        returned, read = rows_read(conn, blockers, (*keys, PENDING, FAILED, last, 0, False, True))
        assert returned == 0 and read <= 3 * len(keys) + len(scanned), read  # a probe a range
        with conn.cursor() as cur:  # schema version 1's index and statement
            cur.execute("CREATE INDEX old_key_head ON outbox (`key`(255), id)")
        old = blockers.replace("`outbox_key_status`", "old_key_head").replace(
            "status IN (%s, %s) AND ", ""
        )
        old_read = rows_read(conn, old, (*keys, last, 0, False, True))[1]
        print(f"ordered blockers of {len(keys)} keys: naive {old_read}, ours {read}")
        assert old_read >= N
        # the whole ordered claim the relay runs, holding every partition
        assert _whole_claim(plan_url, conn, ordered=True)[0] == 0  # holds none yet
        _hold_all(conn)
        claimed, read = _whole_claim(plan_url, conn, ordered=True)
        print(f"ordered claim of {BATCH} at {N} pending: ours {read} (whole claim)")
        # (scan 4 x batch, keys' blockers twice: before and after the lock, at ~3 reads a key)
        assert claimed == BATCH and read <= 30 * BATCH, read
    finally:
        conn.close()


def _scan(o: OrderedStatements, held: list[int]) -> tuple[str, tuple[int, ...]]:
    return scan_query(o, held, 4 * BATCH, 64)


def _hold_all(conn: Any) -> None:
    with conn.cursor() as cur:
        cur.execute(
            "UPDATE outbox_partitions SET owner = 'r',"
            " expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR"
        )


def test_an_ordered_relay_on_a_schema_behind_its_claim_says_to_migrate(plan_url: str) -> None:
    from outboxkit.errors import SchemaError

    migrate(plan_url, kind="ordered", partitions=4)
    conn = _connect(plan_url)
    try:
        with conn.cursor() as cur:  # as a table of ordered schema version 1 has it
            cur.execute("DROP INDEX outbox_pending_id ON outbox")
        _hold_all(conn)
        _load(conn, 10, PENDING, 1)
        with pytest.raises(SchemaError, match="outboxkit migrate --ordered --dsn"):
            _whole_claim(plan_url, conn, ordered=True)
    finally:
        conn.close()
