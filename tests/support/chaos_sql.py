"""The chaos runs' reads of the database, on PostgreSQL or MariaDB (by the DSN's scheme).

The runs (chaos.py, ordered_chaos.py) are the same on both backends: the writers, relays,
faults and the broker-side checks do not care which database holds the outbox; only these
few statements differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pymysql

from outboxkit.backends.mariadb.sql import connect_args, is_mysql_url


@contextmanager
def cursor(dsn: str) -> Iterator[Any]:
    """An autocommit cursor on ``dsn`` (psycopg or PyMySQL: both take ``%s``)."""
    if is_mysql_url(dsn):
        conn = pymysql.connect(**connect_args(dsn), autocommit=True)
        try:
            with conn.cursor() as cur:
                yield cur
        finally:
            conn.close()
    else:
        with psycopg.connect(dsn, autocommit=True) as pg, pg.cursor() as cur:
            yield cur


def scalar(cur: Any, statement: str, params: tuple[Any, ...] = ()) -> int:
    cur.execute(statement, params)
    row = cur.fetchone()
    return int(row[0]) if row else 0


def migrate_ordered(dsn: str, partitions: int) -> None:
    if is_mysql_url(dsn):
        from outboxkit.backends.mariadb.migrate import migrate

        migrate(dsn, kind="ordered", partitions=partitions)
    else:
        from outboxkit.backends.postgres.migrate import migrate as pg_migrate

        pg_migrate(dsn, table="outbox", ordered=True, partitions=partitions)


def ordered_ledger(dsn: str) -> list[tuple[str, str]]:
    """(event id, key) of every committed event, by key and commit order."""
    key = "k" if is_mysql_url(dsn) else "key"
    event_id = "event_id" if is_mysql_url(dsn) else "event_id::text"
    with cursor(dsn) as cur:
        cur.execute(f"SELECT {event_id}, {key} FROM ochaos_ledger ORDER BY {key}, n, pos")
        return [(str(e), str(k)) for e, k in cur.fetchall()]


def lost_rows(dsn: str, ids: list[str]) -> list[tuple[Any, ...]]:
    """What the ledger and the outbox say of events never consumed (for the report)."""
    mysql = is_mysql_url(dsn)
    key, marks = ("l.k", ",".join(["%s"] * len(ids))) if mysql else ("l.key", "")
    where = f"l.event_id IN ({marks})" if mysql else "l.event_id = ANY(%s::uuid[])"
    published = "o.published_at" if mysql else "o.published_at::text"
    with cursor(dsn) as cur:
        cur.execute(
            f"SELECT l.event_id, {key}, l.n, l.pos, o.id, o.status, o.attempts,"
            f" o.claimed_by, {published}, o.last_error"
            " FROM ochaos_ledger AS l LEFT JOIN outbox AS o ON o.event_id = l.event_id"
            f" WHERE {where} ORDER BY {key}, l.n, l.pos",
            tuple(ids) if mysql else (ids,),
        )
        return list(cur.fetchall())
