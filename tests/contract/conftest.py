"""The queue store contract runs every scenario on each backend: ``backend`` (an unordered
queue) and ``ordered_backend`` (ordered mode's partitions), both parametrised by name."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.contract.backends import Backend, MemoryBackend, PostgresBackend

BACKENDS = ["memory", "postgres"]


async def _backend(request: pytest.FixtureRequest, *, ordered: bool) -> AsyncIterator[Backend]:
    if request.param == "postgres":
        backend: Backend = PostgresBackend(request.getfixturevalue("db_dsn"), ordered)
    else:
        backend = MemoryBackend(ordered)
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
