"""The metrics' table gauges through each backend's `GaugeReader` (`Backend.gauge_reader`):
the same rows on PostgreSQL and MariaDB for the same table, and a kept connection the
server killed is replaced at the next reading instead of failing every reading after."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from outboxkit.backends import backend_for
from outboxkit.backends.ports import GaugeReader, GaugeRows
from outboxkit.errors import ConfigurationError
from tests.support.mariadb import MariaDB
from tests.support.mariadb_ops import (
    fill_mariadb,
    fill_postgres,
    mariadb_execute,
    new_database,
    scenario_events,
    tag,
)

CAP = 100


def _plain(rows: GaugeRows, prefix: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Topics without their tag, counts as ints, ages to the minute (10 min written)."""
    pending = sorted(
        (str(t).removeprefix(prefix), int(n), int(f), round((age or 0) / 60))
        for t, n, f, age in rows.pending
    )
    return pending, sorted((str(t).removeprefix(prefix), int(n)) for t, n in rows.failed)


async def _read(url: str) -> GaugeRows:
    gauges = backend_for(url).gauge_reader(url, "outbox")
    try:
        return await gauges.read(CAP)
    finally:
        await gauges.close()


async def test_both_backends_read_the_same_gauges(db_dsn: str, mariadb_server: MariaDB) -> None:
    pg_tag, maria_tag = tag(), tag()
    fill_postgres(db_dsn, scenario_events(pg_tag))
    maria = new_database(mariadb_server)
    fill_mariadb(maria, scenario_events(maria_tag))
    pg = _plain(await _read(db_dsn), pg_tag)
    assert pg == _plain(await _read(maria), maria_tag)
    assert pg == ([(".orders", 4, 1, 10)], [(".mail", 2)])  # (due + scheduled, in flight)


def _kill_pg(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        killed = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'outboxkit-relay:metrics'"
        ).fetchall()
    assert killed == [(True,)]


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
async def test_a_killed_connection_fails_one_reading_and_the_next_reads_again(
    kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "postgresql":
        url = str(request.getfixturevalue("db_dsn"))
        fill_postgres(url, scenario_events(tag()))
    else:
        url = new_database(request.getfixturevalue("mariadb_server"))
        fill_mariadb(url, scenario_events(tag()))
    gauges: GaugeReader = backend_for(url).gauge_reader(url, "outbox")
    try:
        first = _plain(await gauges.read(CAP), "")
        if kind == "postgresql":
            _kill_pg(url)
        else:
            conn: Any = gauges._conn  # type: ignore[attr-defined]
            mariadb_execute(url, f"KILL {conn.thread_id()}")
        await asyncio.sleep(0.1)
        with pytest.raises(gauges.errors):
            await gauges.read(CAP)  # the dead connection's reading fails, once
        assert _plain(await gauges.read(CAP), "") == first  # then a new connection reads again
    finally:
        await gauges.close()


async def test_mariadb_has_no_slot_to_read(mariadb_server: MariaDB) -> None:
    url = new_database(mariadb_server)
    gauges = backend_for(url).gauge_reader(url, "outbox")
    with pytest.raises(ConfigurationError, match="WAL relay"):
        await gauges.slot("outboxkit_outbox")
    await gauges.close()
