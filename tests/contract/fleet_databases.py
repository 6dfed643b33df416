"""The databases the fleet lease contract (test_fleet_leases.py) runs on: one empty database
each, its backend's lease (``Backend.fleet_lease``) and a few reads and clock moves of the
lease table that the scenarios make through SQL of their own.

A new backend joins with a subclass here and its name in ``FLEET_BACKENDS`` (conftest.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg

from outboxkit.backends import backend_for
from outboxkit.backends.postgres.fleet_sql import LOCK
from outboxkit.queue.fleet_leases import DatabaseLease
from outboxkit.testing import create_database, drop_database
from tests.support.mariadb_ops import mariadb_execute
from tests.support.servers import unique_name

SERVICE = "relay:outbox"


class PostgresLeaseDatabase:
    """An empty PostgreSQL database of its own (dropped at close)."""

    name = "postgres"
    _AGE = "UPDATE outboxkit_fleet SET expires_at = expires_at - make_interval(secs => %s)"
    _OWNERS = "SELECT member FROM outboxkit_fleet WHERE service = %s AND owner"

    def __init__(self, server: Any) -> None:
        self.server = server
        self.database = unique_name("fleet")
        create_database(server.dsn, self.database)
        self.dsn = server.dsn_for(self.database)

    def sibling(self) -> PostgresLeaseDatabase:
        """Another empty database on the same server."""
        return type(self)(self.server)

    def lease(self, member: str, ttl: float = 30.0, service: str = SERVICE) -> DatabaseLease:
        return backend_for(self.dsn).fleet_lease(self.dsn, service, member, ttl)

    def _run(self, statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description else []

    def age(self, seconds: float) -> None:
        """Every lease in the table ``seconds`` older (the database's clock moved on)."""
        self._run(self._AGE, (seconds,))

    def owners(self, service: str = SERVICE) -> list[str]:
        return sorted(str(r[0]) for r in self._run(self._OWNERS, (service,)))

    @contextlib.contextmanager
    def check_under_way(self, service: str = SERVICE) -> Iterator[None]:
        """Another process's lease check on ``service`` holding this database's check lock."""
        with psycopg.connect(self.dsn) as conn, conn.transaction():
            conn.execute(LOCK, {"service": service})
            yield

    def close(self) -> None:
        drop_database(self.server.dsn, self.database)


class MariaDBLeaseDatabase(PostgresLeaseDatabase):
    """An empty database of its own on the private MariaDB (dropped at close)."""

    name = "mariadb"
    _AGE = "UPDATE outboxkit_fleet SET expires_at = expires_at - INTERVAL %s MICROSECOND"

    def __init__(self, server: Any) -> None:
        import pymysql

        self.server = server
        self.database = unique_name("fleet")
        self._admin = pymysql.connect(**server.connect_args(), autocommit=True)
        with self._admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {self.database}")
        self.dsn = server.url_for(self.database)

    def _connect(self) -> Any:
        import pymysql

        return pymysql.connect(**self.server.connect_args(self.database), autocommit=True)

    def _run(self, statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return mariadb_execute(self.dsn, statement, params)

    def age(self, seconds: float) -> None:
        self._run(self._AGE, (round(seconds * 1e6),))

    @contextlib.contextmanager
    def check_under_way(self, service: str = SERVICE) -> Iterator[None]:
        from outboxkit.backends.mariadb.fleet_sql import LOCK

        conn = self._connect()
        try:
            with conn.cursor() as cur:
                cur.execute(LOCK, (service, 5))
                assert cur.fetchone() == (1,)
            yield
        finally:
            conn.close()

    def close(self) -> None:
        with self._admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {self.database}")
        self._admin.close()
