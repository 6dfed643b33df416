"""The maintenance chores decide without a database: partitions to create and drop, purges."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import pytest

from outboxkit.errors import OutboxkitError
from outboxkit.maintenance import side_task
from outboxkit.maintenance.partitions import (
    MaintenanceReport,
    PartitionSettings,
    blocks_drop,
    drop_horizon,
    has_expired,
    periods_to_create,
)
from outboxkit.maintenance.purge import in_batches

NOW = dt.datetime(2026, 3, 4, 15, 30, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)
MIDNIGHT = dt.datetime(2026, 3, 4, tzinfo=dt.UTC)


def test_the_current_period_and_those_ahead_are_created_unless_they_exist() -> None:
    settings = PartitionSettings("day", ahead=2)
    plan = periods_to_create("outbox", settings, NOW, [])
    assert [p.name for p in plan] == ["outbox_p20260304", "outbox_p20260305", "outbox_p20260306"]
    assert plan[0].start == MIDNIGHT and plan[0].end == MIDNIGHT + DAY
    existing = [(MIDNIGHT, MIDNIGHT + DAY)]
    assert [p.name for p in periods_to_create("outbox", settings, NOW, existing)] == [
        "outbox_p20260305",
        "outbox_p20260306",
    ]
    # one made by hand over two days covers both: neither is created
    by_hand = [(MIDNIGHT + DAY, MIDNIGHT + 3 * DAY)]
    assert [p.name for p in periods_to_create("outbox", settings, NOW, by_hand)] == [
        "outbox_p20260304"
    ]


def test_the_periods_of_stray_rows_are_created_too_and_marked() -> None:
    settings = PartitionSettings("hour", ahead=1)
    last_week = NOW - 7 * DAY
    plan = periods_to_create(
        "t", settings, NOW, [], [last_week, last_week + dt.timedelta(minutes=1)]
    )
    assert [(p.name, p.holds_strays) for p in plan] == [
        ("t_p2026022515", True),
        ("t_p2026030415", False),
        ("t_p2026030416", False),
    ]


def test_a_partition_expires_when_its_whole_range_is_older_than_the_horizon() -> None:
    keep = 7 * DAY
    horizon = drop_horizon(NOW, keep)
    assert horizon == NOW - keep
    old = (MIDNIGHT - 9 * DAY, MIDNIGHT - 8 * DAY)
    assert has_expired(old, horizon)
    assert not has_expired((old[0], horizon + dt.timedelta(seconds=1)), horizon)
    assert has_expired((old[0], horizon), horizon)
    assert not has_expired(None, horizon), "the default partition never expires"
    confirmed = NOW - 10 * DAY  # the WAL relay confirmed less than the retention window
    assert drop_horizon(NOW, keep, confirmed) == confirmed


@pytest.mark.parametrize(
    ("pending", "failed", "confirmed", "blocks"),
    [
        (False, False, None, False),
        (True, False, None, True),
        (False, True, None, True),
        (True, False, NOW, False),  # a relay that never updates rows: pending is published
        (False, True, NOW, True),  # a dead letter keeps it either way
    ],
)
def test_unsettled_rows_keep_an_expired_partition(
    pending: bool, failed: bool, confirmed: dt.datetime | None, blocks: bool
) -> None:
    assert blocks_drop(pending, failed, confirmed_through=confirmed) is blocks


def test_a_purge_runs_batches_until_one_comes_back_short() -> None:
    batches = iter([3, 3, 1, 3])
    seen: list[int] = []
    total = in_batches(lambda: next(batches), batch_size=3, progress=seen.append)
    assert total == 7 and seen == [3, 3, 1]
    with pytest.raises(ValueError, match="at least 1"):
        in_batches(lambda: 0, batch_size=0)


class _Chore:
    table = "outbox"
    errors: tuple[type[Exception], ...] = (OutboxkitError,)

    def __init__(self, partitioned: bool, runs: list[MaintenanceReport | Exception]) -> None:
        self.partitioned = partitioned
        self.runs = runs
        self.calls = 0

    def is_partitioned(self) -> bool:
        return self.partitioned

    def maintain(self) -> MaintenanceReport:
        self.calls += 1
        run = self.runs.pop(0) if self.runs else MaintenanceReport(self.table)
        if isinstance(run, Exception):
            raise run
        return run


async def test_the_side_task_ends_at_once_on_a_plain_table() -> None:
    chore = _Chore(False, [])
    await asyncio.wait_for(side_task.partition_side_task(chore, asyncio.Event()), 5)
    assert chore.calls == 0


async def test_a_failed_run_is_logged_and_retried_at_the_next_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(side_task, "INTERVAL", 0.01)
    done = MaintenanceReport("outbox", created=["outbox_p20260304"])
    chore = _Chore(True, [OutboxkitError("database down"), done])
    stopping = asyncio.Event()
    caplog.set_level(logging.INFO, "outboxkit.relay.time_partitions")
    task = asyncio.create_task(side_task.partition_side_task(chore, stopping))
    while chore.calls < 3:
        await asyncio.sleep(0.01)
    stopping.set()
    await asyncio.wait_for(task, 5)
    messages = [r.getMessage() for r in caplog.records]
    assert "partition maintenance of outbox failed (database down); retrying later" in messages
    assert "partitions of outbox: created outbox_p20260304; dropped none" in messages


async def test_an_unexpected_error_ends_the_side_task_for_the_relay_to_report() -> None:
    chore = _Chore(True, [RuntimeError("a bug")])
    with pytest.raises(RuntimeError, match="a bug"):
        await asyncio.wait_for(side_task.partition_side_task(chore, asyncio.Event()), 5)


class _DownAtStart(_Chore):
    """A plain table whose database is down for the first ``down`` checks."""

    def __init__(self, down: int) -> None:
        super().__init__(False, [OutboxkitError("database down")] * 5)
        self.down = down
        self.checks = 0

    def is_partitioned(self) -> bool:
        self.checks += 1
        if self.checks <= self.down:
            raise OutboxkitError("database down")
        return False


async def test_a_plain_table_says_nothing_about_partitions_while_its_database_is_down(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the deferred check assumed a partitioned table and logged "partition
    maintenance of outbox failed" for a table that is not partitioned."""
    monkeypatch.setattr(side_task, "INTERVAL", 0.01)
    chore = _DownAtStart(down=3)
    caplog.set_level(logging.INFO, "outboxkit.relay.time_partitions")
    await asyncio.wait_for(side_task.partition_side_task(chore, asyncio.Event()), 5)
    assert chore.checks == 4 and chore.calls == 0
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], caplog.records
