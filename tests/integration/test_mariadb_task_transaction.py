"""``Tasks().transaction(conn)`` on MariaDB/MySQL: the enqueues are queued in the block and
sent with the caller's COMMIT, as ``Outbox.transaction()``'s events are (one multi-statement
query, write/mariadb_commit.py), through PyMySQL, mysqlclient, aiomysql and asyncmy. A block
that raises writes nothing; one that ends commits every task with the business rows, their
ids read back; each task keeps what a plain enqueue does (its key's turn, its unique key).
Over max_allowed_packet: test_mariadb_packet.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymysql
import pytest
from pymysql.constants import CLIENT

from outboxkit.backends.mariadb.migrate import migrate
from outboxkit.backends.mariadb.sql import connect_args
from outboxkit.errors import InvalidEventError
from outboxkit.tasks import Tasks
from outboxkit.tasks.enqueue_mariadb import MariaDBTaskStorage
from tests.support.mariadb import MariaDB
from tests.support.mariadb_drivers import database, driver_module
from tests.support.mariadb_ops import mariadb_execute
from tests.support.mysql_wire import CountingProxy

tasks = Tasks()
tasks.handler("mail")(lambda payload: None)


def _schema(url: str) -> None:
    migrate(url, kind="tasks", table="outboxkit_tasks")
    mariadb_execute(
        url, "CREATE TABLE orders (id INT AUTO_INCREMENT PRIMARY KEY, note TEXT NOT NULL)"
    )


@pytest.fixture(scope="module")
def migrated(mariadb_server: MariaDB) -> Iterator[str]:
    """One database for the module (a task table's migration takes a second or two)."""
    with database(mariadb_server, "tt", _schema) as url:
        yield url


@pytest.fixture
def url(migrated: str) -> str:
    for table in ("outboxkit_tasks", "orders"):
        mariadb_execute(migrated, f"DELETE FROM {table}")
    return migrated


def _connect(driver: str, url: str, port: int | None = None, **options: Any) -> Any:
    args = {**connect_args(url), **({"port": port} if port else {})}
    if driver == "pymysql":
        return pymysql.connect(**args, client_flag=CLIENT.MULTI_STATEMENTS, **options)
    return driver_module("MySQLdb").connect(**args, **options)


async def _aconnect(driver: str, url: str) -> Any:
    args = connect_args(url)
    if driver == "aiomysql":
        args = {**{k: v for k, v in args.items() if k != "database"}, "db": args["database"]}
    return await driver_module(driver).connect(**args)


def _tasks(url: str) -> list[tuple[int, str, str | None, int]]:
    """(id, payload, key, status) of each task, in id order."""
    return [
        (r[0], r[1], r[2], r[3])
        for r in mariadb_execute(
            url, "SELECT id, payload, `key`, status FROM outboxkit_tasks ORDER BY id"
        )
    ]


def _orders(url: str) -> list[str]:
    return [r[0] for r in mariadb_execute(url, "SELECT note FROM orders ORDER BY id")]


@pytest.mark.parametrize("driver", ["pymysql", "mysqlclient"])
def test_the_tasks_commit_with_the_business_rows_in_one_round_trip_ids_read_back(
    url: str, driver: str
) -> None:
    with CountingProxy(connect_args(url)["port"]) as proxy:
        conn = _connect(driver, url, proxy.port)
        try:
            with tasks.transaction(conn) as tx:
                with conn.cursor() as cur:
                    cur.execute("INSERT INTO orders (note) VALUES ('o1')")
                handles = [tx.enqueue("mail", {"n": n}) for n in range(50)]
                keyed = [tx.enqueue("mail", {"k": n}, key="acct-1") for n in range(2)]
                unique = [tx.enqueue("mail", {"u": n}, unique_key="once") for n in range(2)]
                before = len(proxy.queries)
            assert len(proxy.queries) - before == 1  # 54 enqueues and the COMMIT: one query
        finally:
            conn.close()
    rows = _tasks(url)
    assert _orders(url) == ["o1"]
    assert [h.id for h in handles + keyed] + [unique[0].id] == [r[0] for r in rows]
    assert unique[1].id is None  # a live task holds its unique_key: skipped, as enqueue()
    # Each enqueue is a plain enqueue's statement: the key's second task waits its turn
    # (a naive multi-row INSERT reads the key's tasks before any of its rows: both pending).
    assert [r[3] for r in rows if r[2] == "acct-1"] == [0, 5]


def test_a_block_that_raises_writes_nothing_and_sends_nothing(url: str) -> None:
    with CountingProxy(connect_args(url)["port"]) as proxy:
        conn = _connect("pymysql", url, proxy.port)
        try:
            with pytest.raises(RuntimeError), tasks.transaction(conn) as tx:
                with conn.cursor() as cur:
                    cur.execute("INSERT INTO orders (note) VALUES ('rolled back')")
                handle = tx.enqueue("mail", {"n": 1})
                sent = len(proxy.queries)
                raise RuntimeError("the block fails")
            assert len(proxy.queries) - sent == 1  # the ROLLBACK only: no INSERT was sent
        finally:
            conn.close()
    assert (_tasks(url), _orders(url)) == ([], [])
    with pytest.raises(RuntimeError, match="known once its transaction has committed"):
        _ = handle.id


def test_pymysql_without_multi_statements_sends_one_statement_per_task_then_commits(
    url: str,
) -> None:
    conn = pymysql.connect(**connect_args(url))
    try:
        with tasks.transaction(conn) as tx:
            handles = [tx.enqueue("mail", {"n": n}) for n in range(3)]
    finally:
        conn.close()
    assert [h.id for h in handles] == [r[0] for r in _tasks(url)]


@pytest.mark.parametrize("driver", ["aiomysql", "asyncmy"])
async def test_async_drivers_commit_the_tasks_or_on_error_nothing(url: str, driver: str) -> None:
    conn = await _aconnect(driver, url)
    try:
        with pytest.raises(RuntimeError):
            async with tasks.atransaction(conn) as tx:
                tx.enqueue("mail", {"n": "rolled back"})
                raise RuntimeError("the block fails")
        assert _tasks(url) == []
        async with tasks.atransaction(conn) as tx:
            handles = [tx.enqueue("mail", {"n": n}) for n in range(5)]
    finally:
        conn.close()
    assert [h.id for h in handles] == [r[0] for r in _tasks(url)]


def test_what_a_task_transaction_does_not_take_is_refused(url: str) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url.replace("mysql://", "mysql+pymysql://", 1))
    try:
        with engine.connect() as sa, pytest.raises(TypeError, match="PyMySQL or mysqlclient"):
            tasks.transaction(sa)
    finally:
        engine.dispose()
    conn = _connect("pymysql", url)
    try:
        with tasks.transaction(conn) as tx, pytest.raises(InvalidEventError):
            tx.put(object())  # type: ignore[arg-type]
        with tasks.transaction(conn) as tx, pytest.raises(TypeError, match="after="):
            tx.enqueue("mail", after=[1])
    finally:
        conn.close()
    assert MariaDBTaskStorage("outboxkit_tasks").slots([]) == []
