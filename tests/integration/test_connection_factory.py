"""Every connection outboxkit opens comes from one factory: named, autocommit, one timeout."""

from __future__ import annotations

import psycopg
import pytest

from outboxkit.backends.postgres._connection import (
    ADMIN_APPLICATION_NAME,
    aconnect,
    admin_connection,
    connect,
)
from outboxkit.errors import SchemaError

_NAME = "SELECT current_setting('application_name')"


def test_a_connection_is_named_and_autocommit_unless_told(db_dsn: str) -> None:
    with connect(db_dsn, application_name="outboxkit-test:sync") as conn:
        assert conn.autocommit
        assert conn.execute(_NAME).fetchone() == ("outboxkit-test:sync",)
    with connect(db_dsn, application_name="x", autocommit=False) as conn:
        assert not conn.autocommit


def test_the_name_overrides_the_dsns_and_is_cut_to_what_postgres_keeps(db_dsn: str) -> None:
    dsn = psycopg.conninfo.make_conninfo(db_dsn, application_name="from-the-dsn")
    long = "outboxkit-relay:" + "r" * 80
    with connect(dsn, application_name=long) as conn:
        assert conn.execute(_NAME).fetchone() == (long[:63],)


async def test_the_async_twin_names_its_connection_alike(db_dsn: str) -> None:
    async with await aconnect(db_dsn, application_name="outboxkit-test:async") as conn:
        assert conn.autocommit
        cur = await conn.execute(_NAME)
        assert await cur.fetchone() == ("outboxkit-test:async",)


def test_the_admin_commands_connection_is_named_outboxkit_admin(db_dsn: str) -> None:
    with admin_connection(db_dsn, lambda: SchemaError("no table")) as conn:
        assert conn.execute(_NAME).fetchone() == (ADMIN_APPLICATION_NAME,)
    with pytest.raises(SchemaError, match="no table"):
        with admin_connection(db_dsn, lambda: SchemaError("no table")) as conn:
            conn.execute("SELECT * FROM no_such_table")
