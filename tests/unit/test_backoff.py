"""The package's one backoff (outboxkit._backoff): full jitter, for relay and consumers."""

from __future__ import annotations

import ast
import pathlib
import random

import pytest

import outboxkit
from outboxkit import _backoff
from outboxkit._backoff import Backoff, full_jitter
from outboxkit.consumers import base as consumer_base

SRC = pathlib.Path(outboxkit.__file__).parent
DRAWS = 4000


def _runner_class() -> type:
    """The broker-independent consumer runner class, whatever it is named."""
    classes = [
        value
        for value in vars(consumer_base).values()
        if isinstance(value, type) and "_backoff" in vars(value)
    ]
    assert len(classes) == 1, classes
    return classes[0]


def test_full_jitter_stays_within_the_capped_exponential() -> None:
    for attempt in range(0, 80):
        d = full_jitter(attempt, base=0.5, cap=30.0)
        assert 0.0 <= d <= min(30.0, 0.5 * 2 ** max(attempt - 1, 0))


@pytest.mark.parametrize(("attempt", "ceiling"), [(1, 1.0), (3, 4.0), (20, 60.0)])
def test_full_jitter_spans_zero_to_the_ceiling(attempt: int, ceiling: float) -> None:
    """Full jitter, not "equal jitter": delays reach down near zero, not only the upper half."""
    rng = random.Random(11)
    delays = []
    for _ in range(DRAWS):
        random.seed(rng.random())
        delays.append(full_jitter(attempt, base=1.0, cap=60.0))
    assert all(0.0 <= d <= ceiling for d in delays)
    assert min(delays) < 0.05 * ceiling
    assert max(delays) > 0.95 * ceiling
    below_half = sum(d < ceiling / 2 for d in delays) / DRAWS
    assert 0.45 < below_half < 0.55


def test_reconnect_backoff_never_busy_loops_and_resets() -> None:
    b = Backoff(base=0.2, cap=5.0)
    delays = [b.next_delay() for _ in range(200)]
    assert min(delays) >= 0.1
    assert max(delays) <= 5.0
    b.reset()
    assert b.failures == 0


def test_consumer_redelivery_delay_is_the_same_full_jitter() -> None:
    """The consumer's delay used to be uniform in [cap/2, cap] while saying "full jitter"."""
    runner = _runner_class()
    fake = type("R", (), {"retry_delay": 1.0})()
    delays = [runner._backoff(fake, 3) for _ in range(DRAWS)]
    assert all(0.0 <= d <= 4.0 for d in delays)
    assert sum(d < 2.0 for d in delays) > DRAWS // 3  # the lower half is reached
    huge = [runner._backoff(fake, 40) for _ in range(200)]
    assert max(huge) <= consumer_base.MAX_RETRY_DELAY
    fake.retry_delay = 0.0
    assert runner._backoff(fake, 5) == 0.0


def test_no_other_module_draws_its_own_retry_delay() -> None:
    """One implementation: only _backoff.py calls random.uniform (a second backoff would)."""
    users = []
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "uniform"
                and isinstance(node.value, ast.Name)
                and node.value.id == "random"
            ):
                users.append(path.relative_to(SRC).as_posix())
    assert users == [pathlib.Path(_backoff.__file__).name]
