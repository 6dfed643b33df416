"""The ``broker`` fixture: the harness a scenario names with ``parametrize(..., indirect=True)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.brokers.harness import BROKERS, DEDUP_VARIANTS, IN_PROCESS, BrokerHarness


@pytest.fixture
async def broker(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BrokerHarness]:
    """The harness, not yet opened: the scenario opens it, cuttable or not."""
    harness = {**BROKERS, **DEDUP_VARIANTS, **IN_PROCESS}[request.param](request, tmp_path)
    try:
        yield harness
    finally:
        await harness.close()
