"""Fixtures that own the servers: PostgreSQL, NATS JetStream and Kafka on loopback ports.

By default they are real servers started from wheels (`outboxkit.testing`); the
OUTBOXKIT_TEST_DSN, OUTBOXKIT_TEST_NATS_URL and OUTBOXKIT_TEST_KAFKA variables point them at
servers already running instead. Session servers start once; every test gets its own
database (cloned from a migrated template), stream or topic names, so no test depends on
another's leftovers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from outboxkit.testing import (
    EmbeddedKafka,
    EmbeddedNats,
    EmbeddedPostgres,
    EmbeddedServerUnavailable,
    TcpProxy,
    create_database,
    drop_database,
    free_port,
)
from tests.support.mariadb import MariaDB
from tests.support.pgbouncer import PgBouncer
from tests.support.servers import (
    KAFKA_ENV,
    NATS_URL_ENV,
    PG_DSN_ENV,
    ExternalKafka,
    ExternalNats,
    ExternalPostgres,
    KafkaBehindProxy,
    check_kafka,
    check_nats,
    check_postgres,
    require_or_skip,
    stop_without_postgres,
    unique_name,
)

pytest_plugins = ["tests.support.exclusive"]

PgServer = EmbeddedPostgres | ExternalPostgres
NatsServer = EmbeddedNats | ExternalNats
KafkaServer = EmbeddedKafka | ExternalKafka
ProxyFactory = Callable[..., TcpProxy]
_S = TypeVar("_S", EmbeddedNats, EmbeddedKafka, EmbeddedPostgres, PgBouncer, MariaDB)


# --------------------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """The PostgreSQL of this session: `.dsn` (admin, database `postgres`) and `.dsn_for(db)`.

    Without one the run ends with a single line saying why (see `stop_without_postgres`).
    """
    dsn = os.environ.get(PG_DSN_ENV)
    if dsn:
        check_postgres(dsn)
        yield ExternalPostgres(dsn)
        return
    try:
        server = EmbeddedPostgres(fsync=False)
        server.start()
    except EmbeddedServerUnavailable as exc:
        stop_without_postgres(f"the embedded one could not start: {exc}")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def pg_template(pg_server: PgServer) -> Iterator[str]:
    """Name of a database migrated once per session; `db_dsn` clones it, which takes milliseconds.

    The name is unique so that sessions sharing one server (OUTBOXKIT_TEST_DSN) do not collide.
    """
    try:
        from outboxkit.backends.postgres.migrate import migrate
    except ImportError as exc:
        pytest.fail(
            "cannot build the template database: outboxkit.backends.postgres.migrate.migrate"
            f" is not importable ({exc})",
            pytrace=False,
        )
    name = unique_name("outboxkit_template")
    create_database(pg_server.dsn, name)
    try:
        migrate(pg_server.dsn_for(name), table="outbox")
    except Exception as exc:
        failure: Exception | None = exc
    else:
        failure = None
    if failure is not None:
        drop_database(pg_server.dsn, name)
        pytest.fail(f"migrate() failed on the template database: {failure!r}", pytrace=False)
    yield name
    drop_database(pg_server.dsn, name)


@pytest.fixture
def db_dsn(pg_server: PgServer, pg_template: str) -> Iterator[str]:
    """DSN of a fresh database of this test's own, with the `outbox` table migrated."""
    name = unique_name("test")
    create_database(pg_server.dsn, name, template=pg_template)
    yield pg_server.dsn_for(name)
    drop_database(pg_server.dsn, name)


@pytest.fixture
def empty_db_dsn(pg_server: PgServer) -> Iterator[str]:
    """DSN of a fresh database without the outbox table (migration tests)."""
    name = unique_name("test")
    create_database(pg_server.dsn, name)
    yield pg_server.dsn_for(name)
    drop_database(pg_server.dsn, name)


# --------------------------------------------------------------------------- PostgreSQL, logical

LOGICAL_DSN_ENV = "OUTBOXKIT_TEST_LOGICAL_DSN"


@pytest.fixture(scope="session")
def logical_pg_server() -> Iterator[PgServer]:
    """A PostgreSQL with `wal_level=logical` (CDC tests): started once, on a free port.

    The machine's server has wal_level=replica and is not ours to reconfigure.
    OUTBOXKIT_TEST_LOGICAL_DSN points it at a running one (a superuser DSN) instead.
    """
    dsn = os.environ.get(LOGICAL_DSN_ENV)
    if dsn:
        check_postgres(dsn)
        yield ExternalPostgres(dsn)
        return
    with _embedded(lambda: EmbeddedPostgres(fsync=False, logical=True)) as server:
        yield server


@pytest.fixture(scope="session")
def logical_pg(logical_pg_server: PgServer) -> str:
    """Superuser DSN (database `postgres`) of the session's `wal_level=logical` server."""
    return logical_pg_server.dsn


@pytest.fixture
def logical_db_dsn(logical_pg_server: PgServer) -> Iterator[str]:
    """DSN of a fresh database on the logical server, `outbox` migrated; its slots dropped after."""
    from outboxkit.backends.postgres.migrate import migrate

    name = unique_name("cdc")
    create_database(logical_pg_server.dsn, name)
    dsn = logical_pg_server.dsn_for(name)
    migrate(dsn, table="outbox")
    yield dsn
    _drop_replication_slots(logical_pg_server.dsn, name)
    drop_database(logical_pg_server.dsn, name)


def _drop_replication_slots(admin_dsn: str, dbname: str) -> None:
    """Drop the slots of `dbname` (DROP DATABASE refuses while a logical slot exists)."""
    import time

    import psycopg

    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for _ in range(50):
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                " WHERE database = %s AND active_pid IS NOT NULL",
                (dbname,),
            )
            try:
                conn.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                    " WHERE database = %s",
                    (dbname,),
                )
                return
            except psycopg.errors.ObjectInUse:  # the terminated walsender has not exited yet
                time.sleep(0.1)


# --------------------------------------------------------------------------- PgBouncer


@pytest.fixture(scope="session")
def pgbouncer(pg_server: PgServer) -> Iterator[PgBouncer]:
    """A private PgBouncer (Debian's package) in transaction pooling mode in front of
    the session's PostgreSQL, on a free port: `.dsn_for(db)` goes through it."""
    try:
        server = PgBouncer(pg_server.dsn)
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"pgbouncer unavailable: {exc}")
    with _embedded(lambda: server) as started:
        yield started


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[MariaDB]:
    """A private MariaDB (Debian's `mariadbd`) on a free port with its own data directory:
    `.url_for(db)`, `.connect_args(db)`; never the machine's server on 3306."""
    try:
        server = MariaDB()
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"mariadb unavailable: {exc}")
    with _embedded(lambda: server) as started:
        yield started


# --------------------------------------------------------------------------- NATS


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """The session's NATS with JetStream (`.url`); tests use their own stream names on it."""
    url = os.environ.get(NATS_URL_ENV)
    if url:
        check_nats(url)
        yield ExternalNats(url)
        return
    with _embedded(lambda: EmbeddedNats()) as server:
        yield server


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A NATS of this test's own, to stop, kill and restart (streams survive restarts)."""
    with _embedded(lambda: EmbeddedNats(tmp_path / "nats")) as server:
        yield server


# --------------------------------------------------------------------------- Kafka


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaServer]:
    """The session's Kafka-protocol broker (`.bootstrap`, `.url`); tests use their own topics."""
    bootstrap = os.environ.get(KAFKA_ENV)
    if bootstrap:
        check_kafka(bootstrap)
        yield ExternalKafka(bootstrap)
        return
    with _embedded(lambda: EmbeddedKafka()) as server:
        yield server


@pytest.fixture
def proxy_factory() -> Iterator[ProxyFactory]:
    """`factory(host, port, listen_port=None)` -> a started TcpProxy, closed after the test."""
    proxies: list[TcpProxy] = []

    def factory(target_host: str, target_port: int, listen_port: int | None = None) -> TcpProxy:
        proxy = TcpProxy(target_host, target_port, listen_port).start()
        proxies.append(proxy)
        return proxy

    yield factory
    for proxy in proxies:
        proxy.close()


@pytest.fixture
def kafka_behind_proxy(proxy_factory: ProxyFactory) -> Iterator[KafkaBehindProxy]:
    """A broker of this test's own that clients reach only through `.proxy` (cut/pause it).

    The broker advertises the proxy's port, so clients reconnect through the proxy too.
    """
    broker_port = free_port()
    proxy = proxy_factory("127.0.0.1", broker_port)
    with _embedded(lambda: EmbeddedKafka(port=broker_port, advertised_port=proxy.port)) as broker:
        yield KafkaBehindProxy(broker, proxy)


# --------------------------------------------------------------------------- helpers


def _embedded(make: Callable[[], _S]) -> _S:
    """Build and start an embedded server, skipping (or failing in CI) when it is unavailable."""
    try:
        server = make()
        server.start()
    except EmbeddedServerUnavailable as exc:
        require_or_skip(f"embedded server unavailable: {exc}")
    return server
