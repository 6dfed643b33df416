"""The queue store contract runs every scenario on each backend: ``backend`` (an unordered
queue) and ``ordered_backend`` (ordered mode's partitions), both parametrised by name."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from tests.contract.backends import Backend, MariaDBBackend, MemoryBackend, PostgresBackend
from tests.contract.fleet_databases import MariaDBLeaseDatabase, PostgresLeaseDatabase
from tests.contract.task_backends import (
    MariaDBTaskBackend,
    MemoryTaskBackend,
    PostgresTaskBackend,
    TaskBackend,
)

BACKENDS = ["memory", "postgres", "mariadb"]


async def _backend(request: pytest.FixtureRequest, *, ordered: bool) -> AsyncIterator[Backend]:
    if request.param == "mariadb":
        backend: Backend = MariaDBBackend(request.getfixturevalue("mariadb_server"), ordered)
    elif request.param == "postgres":
        backend = PostgresBackend(request.getfixturevalue("db_dsn"), ordered)
    else:
        backend = MemoryBackend(ordered)
    reason = backend.cannot.get(request.node.originalname)
    if reason is not None:
        await backend.close()
        pytest.skip(reason)
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async for b in _backend(request, ordered=False):
        yield b


@pytest.fixture(params=BACKENDS)
async def ordered_backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    async for b in _backend(request, ordered=True):
        yield b


#: The task-store contract (test_task_store.py) runs on these.
TASK_BACKENDS = ["memory", "postgres", "mariadb"]


@pytest.fixture(params=TASK_BACKENDS)
async def task_backend(request: pytest.FixtureRequest) -> AsyncIterator[TaskBackend]:
    if request.param == "mariadb":
        backend: TaskBackend = MariaDBTaskBackend(request.getfixturevalue("mariadb_server"))
    elif request.param == "postgres":
        backend = PostgresTaskBackend(request.getfixturevalue("db_dsn"))
    else:
        backend = MemoryTaskBackend()
    try:
        yield backend
    finally:
        await backend.close()


#: The fleet lease contract (test_fleet_leases.py) runs on these.
FLEET_BACKENDS = ["postgres", "mariadb"]


@pytest.fixture(params=FLEET_BACKENDS)
def lease_database(request: pytest.FixtureRequest) -> Iterator[PostgresLeaseDatabase]:
    if request.param == "mariadb":
        database = MariaDBLeaseDatabase(request.getfixturevalue("mariadb_server"))
    else:
        database = PostgresLeaseDatabase(request.getfixturevalue("pg_server"))
    try:
        yield database
    finally:
        database.close()
