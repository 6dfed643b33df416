"""`@pytest.mark.exclusive` tests run with no other test beside them on two xdist workers.

A small suite runs in a subprocess on two workers: four ordinary tests that each stay 0.3 s,
one exclusive test that does too. Every test records when it ran; the exclusive one's span
must overlap no other test's, while the ordinary ones do run side by side (else the suite
would have lost the parallelism it exists for).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SUITE = """
import json, os, time
import pytest

def _record(name):
    start = time.monotonic()
    time.sleep(0.3)
    with open(os.environ["SPANS"], "a") as f:
        f.write(json.dumps([name, start, time.monotonic()]) + "\\n")

@pytest.mark.parametrize("n", range(4))
def test_ordinary(n):
    _record(f"ordinary{n}")

@pytest.mark.exclusive
def test_alone():
    _record("exclusive")

@pytest.mark.parametrize("n", range(4, 8))
def test_ordinary_after(n):
    _record(f"ordinary{n}")
"""


def test_an_exclusive_test_overlaps_no_other_and_the_rest_run_side_by_side(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    spans_file = tmp_path / "spans.jsonl"
    env = {**os.environ, "SPANS": str(spans_file), "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.support.exclusive",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", "/dev/null",
         "--basetemp", str(tmp_path / "base"), str(tmp_path / "test_suite.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    spans = {name: (start, end) for name, start, end in map(json.loads, spans_file.open())}
    assert len(spans) == 9
    alone_start, alone_end = spans.pop("exclusive")
    for name, (start, end) in spans.items():
        assert end <= alone_start or start >= alone_end, f"{name} ran beside the exclusive test"
    ordinary = sorted(spans.values())
    assert any(b[0] < a[1] for a, b in itertools.pairwise(ordinary)), (
        "no two ordinary tests ran side by side: the workers were serialized"
    )
