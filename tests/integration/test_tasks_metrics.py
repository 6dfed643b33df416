"""Task mode's gauges stay bounded: the busiest task names get series, the rest one (other)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from outboxkit.backends.postgres.migrate import migrate_tasks
from outboxkit.backends.postgres.tasks_pg import task_gauges
from outboxkit.ops.task_metrics import TaskMetrics
from outboxkit.queue.tasks import OTHER_TASKS, ClaimedTask, TaskStatus

TABLE = "outboxkit_tasks"


@pytest.fixture
def tasks_dsn(db_dsn: str) -> Iterator[str]:
    migrate_tasks(db_dsn)
    yield db_dsn


def _fill(dsn: str, counts: dict[str, int], *, status: TaskStatus = TaskStatus.PENDING) -> None:
    with psycopg.connect(dsn) as conn:
        for name, n in counts.items():
            conn.execute(
                f"INSERT INTO {TABLE} (task_name, status)"
                " SELECT %s, %s FROM generate_series(1, %s)",
                (name, int(status), n),
            )


def test_the_gauges_name_only_the_busiest_task_names_and_sum_the_rest(tasks_dsn: str) -> None:
    # 300 distinct names (a generated name per task, the naive way) would be 300 series each
    _fill(tasks_dsn, {"big": 5, "middle": 3, **{f"gen-{i}": 1 for i in range(300)}})
    _fill(tasks_dsn, {"gen-0": 1, "big": 1}, status=TaskStatus.FAILED)
    everything = task_gauges(tasks_dsn, TABLE, max_names=1000)
    assert len(everything) == 302
    rows = {name: rest for name, *rest in task_gauges(tasks_dsn, TABLE, max_names=2)}
    assert set(rows) == {"big", "middle", OTHER_TASKS}
    queued, scheduled, running, failed, oldest = rows[OTHER_TASKS]
    assert (queued, scheduled, running, failed) == (300, 0, 0, 1)
    assert oldest is not None and oldest >= 0
    assert rows["big"][:4] == [5, 0, 0, 1]
    # nothing is lost in the sum
    assert sum(r[0] for r in rows.values()) == sum(r[1] for r in everything)
    assert {name for name, *_ in task_gauges(tasks_dsn, TABLE, max_names=0)} == {OTHER_TASKS}
    with pytest.raises(ValueError, match="negative"):
        task_gauges(tasks_dsn, TABLE, max_names=-1)


def _claimed(name: str) -> ClaimedTask:
    return ClaimedTask(1, name, "default", None, 1, 5, None, 0, dt.datetime.now(dt.UTC))


def test_a_scrape_has_series_for_at_most_max_names_task_names(tasks_dsn: str) -> None:
    _fill(tasks_dsn, {"big": 4, **{f"gen-{i}": 1 for i in range(50)}})
    metrics = TaskMetrics(tasks_dsn, TABLE, max_names=3)
    # the worker's own counters too: a table full of unknown names reaches them as failures
    metrics.settled([], [], [_claimed(f"gen-{i}") for i in range(50)])
    metrics.ran([_claimed("big")], 0.01)
    body = asyncio.run(metrics.render()).decode()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if "task" in s.labels:
                labels.setdefault(family.name, set()).add(s.labels["task"])
    assert labels["outboxkit_tasks_queued"] == {"big", "gen-0", "gen-1", OTHER_TASKS}
    assert len(labels["outboxkit_tasks_finished"]) == 4  # 3 names + (other)
    assert OTHER_TASKS in labels["outboxkit_tasks_finished"]
    assert len(labels["outboxkit_task_run_seconds"]) <= 4
