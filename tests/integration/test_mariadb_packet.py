"""`Outbox.transaction()` on MariaDB when its events outgrow `max_allowed_packet`: on a
private mariadbd started with a 1 MiB limit, the naive single query (every event's INSERT
and the COMMIT, as transaction() sent them before) is refused by the server and loses the
connection; outboxkit splits it into several INSERTs, the last with the COMMIT, and every
event commits, in order, through every driver (ordered mode too). An event whose INSERT
alone is over the limit is refused before anything is sent, naming the limit and its size;
one just under it goes through, so the size counted is no smaller than what is sent.
``Tasks.transaction()``'s enqueues are split and refused the same way."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest
from pymysql.constants import CLIENT

from outboxkit import Event, InvalidEventError, Outbox
from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import EmbeddedServerUnavailable
from outboxkit.tasks import InvalidTaskError, Tasks
from outboxkit.tasks.enqueue_mariadb import MariaDBTaskStorage
from outboxkit.write import mariadb_packet as packet
from outboxkit.write.mariadb_table import MariaDBTableStorage
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database, driver_module
from tests.support.mariadb_ops import mariadb_execute
from tests.support.mysql_wire import CountingProxy
from tests.support.servers import require_or_skip

LIMIT = 1024 * 1024
#: Every byte the drivers escape, and the rest: PyMySQL sends bytes in hex, mysqlclient
#: and asyncmy escaped; either way a quoted payload is longer than the payload.
PAYLOAD = bytes(range(256)) * 160  # 40 KiB
EVENTS = 60  # 2.4 MiB of payload, about 4.8 MiB quoted: five INSERTs or so


@pytest.fixture(scope="module")
def small_packet_server() -> Iterator[MariaDB]:
    """A private mariadbd of this module's own with ``max_allowed_packet`` = 1 MiB."""
    try:
        server = MariaDB(f"--max-allowed-packet={LIMIT}")
        server.start()
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"mariadb unavailable: {exc}")
    try:
        yield server
    finally:
        server.close()


def _schema(url: str) -> None:
    migrate(url)
    migrate(url, kind="ordered", table="ordered_outbox")
    mariadb_execute(
        url, "CREATE TABLE orders (id INT AUTO_INCREMENT PRIMARY KEY, note TEXT NOT NULL)"
    )


@pytest.fixture
def url(small_packet_server: MariaDB) -> Iterator[str]:
    with database(small_packet_server, "pkt", _schema) as url:
        yield url


def _events(count: int = EVENTS, payload: bytes = PAYLOAD) -> list[Event]:
    return [
        Event(
            topic="orders",
            key=f"k{i % 7}",
            event_type="order.placed",
            payload=payload,
            headers={"note": 'it\'s "quoted" \\ and non-ASCII: é€😀'},
        )
        for i in range(count)
    ]


def _committed(url: str, table: str = "outbox") -> list[tuple[str, bytes]]:
    return [
        (r[0], r[1])
        for r in mariadb_execute(url, f"SELECT event_id, payload FROM {table} ORDER BY id")
    ]


def _orders(url: str) -> list[str]:
    return [r[0] for r in mariadb_execute(url, "SELECT note FROM orders ORDER BY id")]


def _connect(driver: str, url: str, port: int | None = None) -> Any:
    args = {**connect_args(url), **({"port": port} if port else {})}
    if driver == "pymysql":
        return pymysql.connect(**args, client_flag=CLIENT.MULTI_STATEMENTS)
    return driver_module("MySQLdb").connect(**args)


async def _aconnect(driver: str, url: str) -> Any:
    args = connect_args(url)
    if driver == "aiomysql":
        args = {**{k: v for k, v in args.items() if k != "database"}, "db": args["database"]}
    return await driver_module(driver).connect(**args)


def test_the_naive_single_query_over_max_allowed_packet_is_refused_and_loses_everything(
    url: str,
) -> None:
    """What transaction() sent before: every event's INSERT and the COMMIT in one query."""
    events = _events()
    storage = MariaDBTableStorage("outbox")
    stmt, params = storage.insert([storage.row(e) for e in events])
    conn = _connect("pymysql", url)
    try:
        with conn.cursor() as cur:
            cur.execute("INSERT INTO orders (note) VALUES ('naive')")
            with pytest.raises(pymysql.err.OperationalError) as refused:
                cur.execute(stmt.text + ";\nCOMMIT", params)
                while cur.nextset():
                    pass
    finally:
        conn.close()
    # 1153 (got a packet bigger than 'max_allowed_packet'), or the connection it dropped.
    assert refused.value.args[0] in (1153, 2006, 2013)
    assert (_orders(url), _committed(url)) == ([], [])


@pytest.mark.parametrize("driver", ["pymysql", "mysqlclient"])
def test_a_transaction_over_max_allowed_packet_is_split_and_commits_every_event_in_order(
    url: str, driver: str
) -> None:
    events = _events()
    with CountingProxy(connect_args(url)["port"]) as proxy:
        conn = _connect(driver, url, proxy.port)
        try:
            with Outbox().transaction(conn) as tx:
                with conn.cursor() as cur:
                    cur.execute("INSERT INTO orders (note) VALUES ('split')")
                tx.put_many(events[:30])
                for event in events[30:]:
                    tx.put(event)
        finally:
            conn.close()
        sent = proxy.queries
    assert sent.count(b"SELECT @@max_allowed_packet") == 1  # once, for this connection
    inserts = [q for q in sent if q.startswith(b"INSERT INTO `outbox`")]
    assert sent[-len(inserts) :] == inserts  # sent at the end of the block, nothing after
    assert len(inserts) >= 5
    assert all(len(q) + 1 <= LIMIT for q in inserts)  # (+1: the command byte)
    assert [q.endswith(b";\nCOMMIT") for q in inserts] == [False] * (len(inserts) - 1) + [True]
    assert _orders(url) == ["split"]
    assert _committed(url) == [(str(e.event_id), PAYLOAD) for e in events]


@pytest.mark.parametrize("driver", ["aiomysql", "asyncmy"])
async def test_async_a_transaction_over_max_allowed_packet_is_split_and_commits_in_order(
    url: str, driver: str
) -> None:
    events = _events()
    conn = await _aconnect(driver, url)
    try:
        async with Outbox().atransaction(conn) as tx:
            async with conn.cursor() as cur:
                await cur.execute("INSERT INTO orders (note) VALUES ('split')")
            tx.put_many(events)
    finally:
        conn.close()
    await asyncio.sleep(0)
    assert _orders(url) == ["split"]
    assert _committed(url) == [(str(e.event_id), PAYLOAD) for e in events]


def test_ordered_mode_splits_too_and_every_insert_locks_all_the_keys(url: str) -> None:
    events = _events()
    with CountingProxy(connect_args(url)["port"]) as proxy:
        conn = _connect("pymysql", url, proxy.port)
        try:
            with Outbox("ordered_outbox", ordered=True).transaction(conn) as tx:
                tx.put_many(events)
        finally:
            conn.close()
        inserts = [q for q in proxy.queries if q.startswith(b"INSERT")]
    assert len(inserts) >= 5
    # every INSERT locks all 7 keys' rows, in one order: never taken in crossed orders
    locked = {re.search(rb"WHERE slot IN \(([^)]*)\) FOR UPDATE", q)[1] for q in inserts}
    assert len(locked) == 1
    assert len(locked.pop().split(b",")) == 7
    assert _committed(url, "ordered_outbox") == [(str(e.event_id), PAYLOAD) for e in events]


def _fitting_payload(limit: int, slack: int) -> bytes:
    """A payload whose event's INSERT is ``slack`` bytes under what outboxkit lets through."""
    storage = MariaDBTableStorage("outbox")
    fixed, per_row = storage.shape(0)
    event = _events(1, b"")[0]
    empty = fixed + per_row + packet.exact_size(storage.row(event))
    room = limit - packet.SLACK - empty - slack
    return b"'" * (room // 2)  # hex in PyMySQL: two bytes a byte


@pytest.mark.parametrize("driver", ["pymysql", "mysqlclient"])
def test_an_event_too_large_for_any_insert_is_refused_at_put_before_anything_is_sent(
    url: str, driver: str
) -> None:
    too_large = _events(1, _fitting_payload(LIMIT, -2))[0]
    with CountingProxy(connect_args(url)["port"]) as proxy:
        conn = _connect(driver, url, proxy.port)
        try:
            with pytest.raises(InvalidEventError, match=r"max_allowed_packet of 1048576 bytes"):
                with Outbox().transaction(conn) as tx:
                    with conn.cursor() as cur:
                        cur.execute("INSERT INTO orders (note) VALUES ('refused')")
                    tx.put(_events(1)[0])
                    tx.put(too_large)  # refused here: the caller may catch it and go on
        finally:
            conn.close()
        sent = proxy.queries
    assert not any(q.startswith(b"INSERT INTO `outbox`") for q in sent)
    assert (_orders(url), _committed(url)) == ([], [])


async def test_async_an_event_too_large_is_refused_before_anything_is_sent(url: str) -> None:
    """Async put() cannot ask the limit (it is not awaited): the end of the block refuses it,
    before any INSERT, and rolls back."""
    too_large = _events(1, _fitting_payload(LIMIT, -2))[0]
    conn = await _aconnect("asyncmy", url)
    try:
        with pytest.raises(InvalidEventError, match=r"event #2 .* max_allowed_packet"):
            async with Outbox().atransaction(conn) as tx:
                async with conn.cursor() as cur:
                    await cur.execute("INSERT INTO orders (note) VALUES ('refused')")
                tx.put_many([_events(1)[0], too_large])
    finally:
        conn.close()
    await asyncio.sleep(0)
    assert (_orders(url), _committed(url)) == ([], [])


@pytest.mark.parametrize("driver", ["pymysql", "mysqlclient"])
def test_an_event_just_under_the_limit_goes_through(url: str, driver: str) -> None:
    """The size outboxkit counts is no smaller than the query sent: at the edge it lets
    through, the server takes it."""
    fits = _events(1, _fitting_payload(LIMIT, 0))[0]
    conn = _connect(driver, url)
    try:
        with Outbox().transaction(conn) as tx:
            tx.put(fits)
            tx.put(_events(1)[0])  # a second INSERT, with the COMMIT
    finally:
        conn.close()
    assert [len(p) for _, p in _committed(url)] == [len(fits.payload), len(PAYLOAD)]


# -- Tasks.transaction(): the enqueues, split as the events are ---------------------------------

tasks = Tasks()
tasks.handler("report")(lambda payload: None)
#: A payload whose every character PyMySQL escapes: 40 KiB of JSON, 80 KiB quoted.
QUOTES = "'" * 40_000


@pytest.fixture(scope="module")
def tasks_migrated(small_packet_server: MariaDB) -> Iterator[str]:
    def schema(url: str) -> None:
        migrate(url, kind="tasks", table="outboxkit_tasks")
        _schema(url)

    with database(small_packet_server, "pktt", schema) as url:
        yield url


@pytest.fixture
def tasks_url(tasks_migrated: str) -> str:
    for table in ("outboxkit_tasks", "orders"):
        mariadb_execute(tasks_migrated, f"DELETE FROM {table}")
    return tasks_migrated


def _task_ids(url: str) -> list[int]:
    return [r[0] for r in mariadb_execute(url, "SELECT id FROM outboxkit_tasks ORDER BY id")]


def test_the_naive_single_query_of_many_enqueues_is_refused_by_the_server(
    tasks_url: str,
) -> None:
    storage = MariaDBTaskStorage("outboxkit_tasks")
    rows = [storage.row(tasks._params("report", QUOTES, None, None, None, 0, "default", None,
                                      None)) for _ in range(EVENTS)]  # fmt: skip
    stmt, params = storage.insert(rows)
    conn = _connect("pymysql", tasks_url)
    try:
        with conn.cursor() as cur, pytest.raises(pymysql.err.OperationalError):
            cur.execute(stmt.text + ";\nCOMMIT", params)
            while cur.nextset():
                pass
    finally:
        conn.close()
    assert _task_ids(tasks_url) == []


@pytest.mark.parametrize("driver", ["pymysql", "aiomysql"])
def test_a_task_transaction_over_max_allowed_packet_is_split_and_commits_every_task(
    tasks_url: str, driver: str
) -> None:
    with CountingProxy(connect_args(tasks_url)["port"]) as proxy:
        if driver == "pymysql":
            conn = _connect(driver, tasks_url, proxy.port)
            try:
                with tasks.transaction(conn) as tx:
                    with conn.cursor() as cur:
                        cur.execute("INSERT INTO orders (note) VALUES ('split')")
                    handles = [tx.enqueue("report", QUOTES) for _ in range(EVENTS)]
            finally:
                conn.close()
        else:

            async def run() -> list[Any]:
                args = {**connect_args(tasks_url), "port": proxy.port}
                args["db"] = args.pop("database")
                conn = await driver_module(driver).connect(**args)
                try:
                    async with tasks.atransaction(conn) as tx:
                        async with conn.cursor() as cur:
                            await cur.execute("INSERT INTO orders (note) VALUES ('split')")
                        return [tx.enqueue("report", QUOTES) for _ in range(EVENTS)]
                finally:
                    conn.close()

            handles = asyncio.run(run())
        sent = proxy.queries
    inserts = [q for q in sent if q.startswith(b"INSERT IGNORE INTO `outboxkit_tasks`")]
    assert sent[-len(inserts) :] == inserts and len(inserts) >= 3
    assert all(len(q) + 1 <= LIMIT for q in inserts)  # (+1: the command byte)
    assert [q.endswith(b";\nCOMMIT") for q in inserts] == [False] * (len(inserts) - 1) + [True]
    assert _orders(tasks_url) == ["split"]
    assert [h.id for h in handles] == _task_ids(tasks_url) and len(handles) == EVENTS


def test_a_task_too_large_for_any_insert_is_refused_at_enqueue_before_anything_is_sent(
    tasks_url: str,
) -> None:
    with CountingProxy(connect_args(tasks_url)["port"]) as proxy:
        conn = _connect("pymysql", tasks_url, proxy.port)
        try:
            with pytest.raises(InvalidTaskError, match=r"max_allowed_packet of 1048576 bytes"):
                with tasks.transaction(conn) as tx:
                    with conn.cursor() as cur:
                        cur.execute("INSERT INTO orders (note) VALUES ('refused')")
                    tx.enqueue("report", QUOTES)
                    tx.enqueue("report", "'" * 600_000)  # 1.2 MB quoted: refused here
        finally:
            conn.close()
        sent = proxy.queries
    assert not any(q.startswith(b"INSERT IGNORE INTO `outboxkit_tasks`") for q in sent)
    assert (_orders(tasks_url), _task_ids(tasks_url)) == ([], [])
