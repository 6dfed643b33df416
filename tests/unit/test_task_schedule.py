"""Cron expressions and their slots (outboxkit.tasks.schedule), no server."""

from __future__ import annotations

import datetime as dt

import pytest

from outboxkit.tasks.schedule import Cron

T0 = dt.datetime(2026, 11, 26, 10, 0, tzinfo=dt.UTC)


def test_every_five_minutes_fires_on_the_fives() -> None:
    cron = Cron.parse("*/5 * * * *")
    slots = list(cron.slots(T0, T0 + dt.timedelta(minutes=16)))
    assert [s.minute for s in slots] == [5, 10, 15]


def test_a_six_field_expression_has_seconds() -> None:
    cron = Cron.parse("*/20 * * * * *")
    assert [s.second for s in cron.slots(T0, T0 + dt.timedelta(minutes=1))] == [20, 40, 0]


def test_ranges_lists_and_weekdays() -> None:
    cron = Cron.parse("30 9-10 * * 1-5")  # weekdays at 9:30 and 10:30
    week = list(cron.slots(T0, T0 + dt.timedelta(days=7)))
    assert len(week) == 10 and all(s.isoweekday() <= 5 for s in week)
    assert Cron.parse("0 0 1,15 * *").matches(dt.datetime(2026, 1, 15, tzinfo=dt.UTC))


def test_the_last_slot_within_a_window() -> None:
    cron = Cron.parse("0 * * * *")
    at = T0 + dt.timedelta(minutes=59)
    assert cron.last_slot(at, dt.timedelta(hours=2)) == T0
    assert cron.last_slot(at, dt.timedelta(minutes=30)) is None


@pytest.mark.parametrize("bad", ["* * *", "61 * * * *", "*/0 * * * *", "a * * * *"])
def test_a_bad_expression_says_what_is_wrong(bad: str) -> None:
    with pytest.raises(ValueError, match="cron expression"):
        Cron.parse(bad)
