"""The chaos run (tests/support/chaos.py): nothing lost, nothing phantom, no duplicate.

The suite runs a short version (OUTBOXKIT_CHAOS_SECONDS, default 22 s of writing: with
seed 1 every fault kind has struck by about 21 s, 8 faults in all);
``make chaos`` runs a long one and writes its report to bench/results/chaos.json.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.chaos import FAULTS, ChaosRun

# Drives the CPUs itself (many processes, real faults): run alone under xdist.
pytestmark = pytest.mark.exclusive

SECONDS = float(os.environ.get("OUTBOXKIT_CHAOS_SECONDS", "22"))
REPORT = os.environ.get("OUTBOXKIT_CHAOS_REPORT")
KEEP = os.environ.get("OUTBOXKIT_CHAOS_DIR")  # keep the logs there, for a person to read


@pytest.mark.slow
@pytest.mark.timeout(int(SECONDS) + 420)
def test_chaos_run_loses_nothing_publishes_no_phantom_and_no_duplicate(
    db_dsn: str, tmp_path: Path
) -> None:
    workdir = Path(KEEP) if KEEP else tmp_path / "chaos"
    report = ChaosRun(db_dsn, workdir, seconds=SECONDS, seed=1).run()
    print(report.to_json())
    if REPORT:
        Path(REPORT).write_text(report.to_json() + "\n")
    assert report.committed > 0
    assert report.rolled_back > 0
    assert report.poison > 0
    # Each kind of poison was written: among them an event at the default size limit (over
    # NATS's max_payload with its headers) and a row with a Status header (issue 26).
    assert set(report.poison_kinds) == {"limit", "oversized", "poison", "status"}, report
    assert sum(report.faults.values()) >= SECONDS / 6
    assert set(report.faults) == set(FAULTS), report.faults  # every kind struck at least once
    assert report.violations() == [], report.to_json()
