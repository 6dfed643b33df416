"""MariaDB's default isolation, REPEATABLE READ, against the relay's claim (issue 23).

Under REPEATABLE READ a transaction reads one snapshot, taken at its first plain read,
while InnoDB's locking reads (``FOR UPDATE``) see the latest committed rows. A poller
that keeps one transaction open therefore locks and leases an event committed after its
snapshot yet cannot read it back: the event sits leased with nothing published. The
store's sessions run READ COMMITTED whatever the server's default; these tests show the
naive failure on a real server first, then that the store claims such rows whole.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pymysql
import pytest

from outboxkit import Event, OutboundMessage
from outboxkit.backends.mariadb.queue import MariaDBQueueStore
from outboxkit.backends.mariadb.sql import Statements, connect_args, with_ids
from outboxkit.queue.store import DONE
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import commit_events, new_database

#: MariaDB 10.11 names the variable tx_isolation (transaction_isolation from 11.1 on).
ISOLATION = "SELECT @@GLOBAL.tx_isolation, @@SESSION.tx_isolation"


@pytest.fixture
def url(mariadb_server: MariaDB) -> Iterator[str]:
    """A fresh migrated database, the server's global default set to REPEATABLE READ
    (MariaDB's own default, set explicitly so the test does not depend on it)."""
    admin = pymysql.connect(**mariadb_server.connect_args(), autocommit=True)
    try:
        with admin.cursor() as cur:
            cur.execute("SELECT @@GLOBAL.tx_isolation")
            (before,) = cur.fetchone()
            cur.execute("SET GLOBAL tx_isolation = 'REPEATABLE-READ'")
        yield new_database(mariadb_server)
    finally:
        with admin.cursor() as cur:
            cur.execute("SET GLOBAL tx_isolation = %s", (before,))
        admin.close()


def _write(url: str, topic: str) -> Event:
    event = Event(topic=topic, event_type="order.placed", payload={"topic": topic})
    commit_events(url, [event])
    return event


def test_a_naive_poller_in_repeatable_read_leases_a_new_event_it_cannot_read(url: str) -> None:
    """One long transaction in the inherited REPEATABLE READ: its plain SELECT misses the
    event committed after its snapshot, its locking claim takes it, its read-back is empty."""
    sq = Statements("outbox")
    poller = pymysql.connect(**connect_args(url))  # the driver's default: no autocommit
    try:
        with poller.cursor() as cur:
            cur.execute(ISOLATION)
            assert cur.fetchone() == ("REPEATABLE-READ", "REPEATABLE-READ")
            cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            cur.execute("SELECT COUNT(*) FROM outbox")
            assert cur.fetchone() == (0,)
            _write(url, "after.snapshot")
            cur.execute("SELECT COUNT(*) FROM outbox")
            assert cur.fetchone() == (0,)  # the snapshot does not see it
            cur.execute(sq.claim_lock, (10,))
            locked = [r[0] for r in cur.fetchall()]
            assert len(locked) == 1  # the locking read does: the row is now this poller's
            cur.execute(with_ids(sq.claim_read, 1), locked)
            assert cur.fetchall() == ()  # ... and reading its payload back finds nothing
        poller.commit()
    finally:
        poller.close()


async def test_the_store_claims_events_committed_after_it_started_and_after_each_claim(
    url: str,
) -> None:
    """The server's default stays REPEATABLE READ; the store's sessions run READ COMMITTED
    and each claim reads whole every event committed since the last one.

    The claim's transaction is short and locks before it reads, so today's unordered claim
    would also pass these claims in REPEATABLE READ: the session isolation is asserted so
    that a read added before the lock (as ordered mode's scan) cannot meet a stale snapshot.
    """
    store: MariaDBQueueStore[OutboundMessage] = MariaDBQueueStore(url, "outbox", OutboundMessage)

    async def isolation(role: str) -> Any:
        async def read(cur: Any) -> Any:
            await cur.execute(ISOLATION)
            return await cur.fetchone()

        return await store._run(role, read)

    async def claim_one() -> list[OutboundMessage]:
        got = await store.claim(limit=10, lease=30, token=uuid.uuid4(), owner="r", max_attempts=5)
        if got is None:
            return []
        settled = await store.settle(got, [DONE] * len(got.items))
        assert (list(settled.ids), settled.lost) == (got.ids, 0)
        return list(got.items)

    try:
        await store.start()
        assert await isolation("claim") == ("REPEATABLE-READ", "READ-COMMITTED")
        assert await claim_one() == []  # a claim before any event: its session is now used
        first = _write(url, "after.start")
        got = await claim_one()
        assert [(m.event_id, m.topic, orjson.loads(m.payload)) for m in got] == [
            (first.event_id, "after.start", {"topic": "after.start"})
        ]
        second = _write(url, "after.claim")
        got = await claim_one()
        assert [(m.event_id, orjson.loads(m.payload)) for m in got] == [
            (second.event_id, {"topic": "after.claim"})
        ]
        assert await isolation("settle") == ("REPEATABLE-READ", "READ-COMMITTED")
    finally:
        await store.close()
